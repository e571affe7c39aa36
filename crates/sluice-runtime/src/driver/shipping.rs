//! What each stage of a job sends to its tasks, prepared once when the job is accepted: worker stages
//! are encoded with the wire codec (one encoding shared by every task and attempt of the stage: the
//! one the wire check made when the graph was built, while the stage still has that plan);
//! driver stages keep their in-memory plan and the session's context. The session's settings go as
//! the ones a worker could not know ([`shipped_settings`]), not all of DataFusion's two hundred.
//!
//! Where a stage runs is decided once, by the job graph builder (`Stage::placement`); this module only
//! follows it. A worker stage that cannot be encoded fails the job here, before any task runs,
//! naming the stage.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use datafusion::common::config::ConfigOptions;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::prelude::SessionConfig;
use sluice_planner::{JobGraph, TaskPlacement};

use crate::codec::encode_stage_plan;
use crate::definition::{CASCADED_SETTINGS, StagePlan};

/// The plan every task of each stage of `graph` runs, by stage.
pub(super) fn ship_stages(graph: &JobGraph, context: &Arc<TaskContext>) -> Result<Vec<StagePlan>> {
    graph
        .stages()
        .iter()
        .enumerate()
        .map(|(id, stage)| match stage.placement {
            TaskPlacement::Driver => Ok(StagePlan::InMemory {
                plan: Arc::clone(&stage.plan),
                context: Arc::clone(context),
            }),
            TaskPlacement::Worker => match stage.wire_bytes() {
                Some(bytes) => Ok(bytes.clone()),
                None => encode_stage_plan(Arc::clone(&stage.plan)),
            }
            .map(StagePlan::Encoded)
            .map_err(|e| {
                DataFusionError::Plan(format!("stage {id} cannot be sent to workers: {e}"))
            }),
        })
        .collect()
}

/// Settings whose default depends on the machine (its cores): always shipped, as a worker's own
/// default may differ from the driver's.
const MACHINE_DEPENDENT: &[&str] = &[
    "datafusion.execution.target_partitions",
    "datafusion.execution.planning_concurrency",
];

/// DataFusion's default value of every setting, and Sluice's (this process's; see
/// [`MACHINE_DEPENDENT`]).
static DEFAULTS: LazyLock<HashMap<String, Option<String>>> = LazyLock::new(|| {
    let mut options = ConfigOptions::default();
    options
        .extensions
        .insert(crate::options::SluiceOptions::default());
    options
        .entries()
        .into_iter()
        .map(|entry| (entry.key, entry.value))
        .collect()
});

/// The settings of `config` a task needs shipped: every one set to other than DataFusion's default,
/// the machine-dependent ones and the cascaded ones (`CASCADED_SETTINGS`). A worker starts from
/// the same defaults (the driver refuses a worker of another version) and applies these
/// (`session_config_of`), so its tasks see the session's settings; a task definition carries a
/// handful of entries instead of every setting.
pub(super) fn shipped_settings(config: &SessionConfig) -> HashMap<String, String> {
    config
        .options()
        .entries()
        .into_iter()
        .filter_map(|entry| {
            let value = entry.value?;
            let keep = MACHINE_DEPENDENT.contains(&entry.key.as_str())
                || CASCADED_SETTINGS.contains(&entry.key.as_str())
                || DEFAULTS.get(&entry.key) != Some(&Some(value.clone()));
            keep.then_some((entry.key, value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    /// Every setting of `config`, as sorted (key, value) pairs.
    fn settings(config: &SessionConfig) -> Vec<(String, Option<String>)> {
        let mut entries: Vec<_> = config
            .options()
            .entries()
            .into_iter()
            .map(|entry| (entry.key, entry.value))
            .collect();
        entries.sort();
        entries
    }

    #[tokio::test]
    async fn a_worker_stage_ships_the_bytes_its_wire_check_made_and_a_replaced_plan_is_encoded_again()
     {
        let ctx = datafusion::prelude::SessionContext::new();
        ctx.sql("create table t as values (1, 10), (2, 20)")
            .await
            .unwrap();
        let plan = ctx
            .sql("select column1, count(*) from t group by column1")
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let graph = sluice_planner::JobGraph::try_new_with(
            plan,
            &crate::codec::distributed_graph_options(),
        )
        .unwrap();
        let shipped = ship_stages(&graph, &ctx.task_ctx()).unwrap();
        let mut checked = 0;
        for (stage, plan) in graph.stages().iter().zip(&shipped) {
            if let (Some(bytes), StagePlan::Encoded(sent)) = (stage.wire_bytes(), plan) {
                // The same buffer, not an equal encoding made again.
                assert_eq!(sent.as_ptr(), bytes.as_ptr());
                checked += 1;
            }
        }
        assert_eq!(checked, graph.stages().len(), "{:#?}", graph.stages());
        // A stage whose plan changed after the check ships its new plan.
        let mut stages = graph.stages().to_vec();
        let last = stages.len() - 1;
        let old = Arc::clone(&stages[last].plan);
        let bytes = crate::codec::encode_stage_plan(Arc::clone(&old)).unwrap();
        let rebuilt = crate::codec::decode_stage_plan(&bytes, &ctx.task_ctx()).unwrap();
        assert!(!Arc::ptr_eq(&rebuilt, &old));
        stages[last].plan = Arc::clone(&rebuilt);
        let changed =
            sluice_planner::JobGraph::from_stages(stages, Arc::clone(graph.schema())).unwrap();
        assert!(changed.stages()[last].wire_bytes().is_none());
        let shipped = ship_stages(&changed, &ctx.task_ctx()).unwrap();
        let StagePlan::Encoded(sent) = &shipped[last] else {
            panic!("the final stage runs on a worker");
        };
        // Encoded now, from the new plan: not the check's buffer of the old one.
        let checked_bytes = graph.stages()[last].wire_bytes().unwrap();
        assert_ne!(sent.as_ptr(), checked_bytes.as_ptr());
        assert_eq!(sent, &crate::codec::encode_stage_plan(rebuilt).unwrap());
    }

    #[test]
    fn only_changed_machine_dependent_and_cascaded_settings_are_shipped_and_they_rebuild_the_session()
     {
        let config = crate::options::with_sluice_options(SessionConfig::new())
            .set_u64("sluice.skew_join_factor", 6)
            .with_batch_size(1234)
            .set_str("datafusion.execution.time_zone", "Europe/Paris")
            .set_bool("datafusion.optimizer.prefer_hash_join", false)
            // Turns the three dynamic filter settings off, then one of them on again: applied
            // in DataFusion's field order, the first would undo the second.
            .set_bool("datafusion.optimizer.enable_dynamic_filter_pushdown", false)
            .set_bool(
                "datafusion.optimizer.enable_aggregate_dynamic_filter_pushdown",
                true,
            );
        let shipped = shipped_settings(&config);
        let mut keys: Vec<&str> = shipped.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "datafusion.execution.batch_size",
                "datafusion.execution.planning_concurrency",
                "datafusion.execution.target_partitions",
                "datafusion.execution.time_zone",
                "datafusion.optimizer.enable_aggregate_dynamic_filter_pushdown",
                "datafusion.optimizer.enable_dynamic_filter_pushdown",
                "datafusion.optimizer.enable_join_dynamic_filter_pushdown",
                "datafusion.optimizer.enable_topk_dynamic_filter_pushdown",
                "datafusion.optimizer.prefer_hash_join",
                "sluice.skew_join_factor",
            ]
        );
        assert_eq!(shipped["datafusion.execution.batch_size"], "1234");
        // What the worker rebuilds is the session's settings, every one of them.
        let rebuilt = crate::definition::session_config_of(&shipped).unwrap();
        assert_eq!(settings(&rebuilt), settings(&config));
    }
}
