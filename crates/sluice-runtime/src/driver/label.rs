//! [`JobLabel`]: what a front end says about the statement a job runs (its tag, SQL text and user),
//! carried to the driver as an extension of the job's session config so that the driver can name
//! the job in its progress without knowing who submitted it.
//!
//! Invariant: the label is descriptive only; scheduling never reads it.

use datafusion::execution::TaskContext;
use datafusion::prelude::SessionConfig;
use std::sync::Arc;

/// Who asked for a job, as its front end names it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobLabel {
    /// A key unique on the front end (`flight-sql statement 12`), which it uses to find the job's
    /// progress.
    pub tag: String,
    /// The statement's SQL text.
    pub sql: String,
    /// The user the statement runs for.
    pub user: String,
}

impl JobLabel {
    /// The label `context` carries, if any.
    pub fn of(context: &TaskContext) -> Option<Arc<JobLabel>> {
        context.session_config().get_extension::<JobLabel>()
    }

    /// `config` carrying this label.
    pub fn attach(self, config: SessionConfig) -> SessionConfig {
        config.with_extension(Arc::new(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_attached_to_a_config_is_read_back_from_its_task_context() {
        let label = JobLabel {
            tag: "flight-sql statement 7".to_string(),
            sql: "select 1".to_string(),
            user: "ann".to_string(),
        };
        let config = label.clone().attach(SessionConfig::new());
        let context = TaskContext::default().with_session_config(config);
        assert_eq!(JobLabel::of(&context).as_deref(), Some(&label));
        assert_eq!(JobLabel::of(&TaskContext::default()), None);
    }
}
