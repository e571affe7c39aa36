//! Live progress of running jobs, computed by the driver actor on request: per stage, tasks done,
//! running and total, and rows its finished tasks wrote; per job, regions retried.

use std::fmt::Write;
use std::sync::Arc;

use super::JobLabel;

/// One stage's progress.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageProgress {
    /// Tasks of the stage.
    pub total: usize,
    /// Tasks placed and not finished.
    pub running: usize,
    /// Tasks whose latest attempt succeeded.
    pub done: usize,
    /// Rows written by the succeeded tasks.
    pub rows: u64,
}

/// One job's progress.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobProgress {
    /// The job id.
    pub job: u64,
    /// Per stage, in stage order.
    pub stages: Vec<StageProgress>,
    /// Regions retried so far.
    pub retries: usize,
    /// Who asked for the job, when its front end said.
    pub label: Option<Arc<JobLabel>>,
}

impl JobProgress {
    /// One line for a terminal: `job 3 · tasks 9/14 (4 running) · s0 4/4 12.0k rows · s1 1/4 …`.
    pub fn line(&self) -> String {
        let total: usize = self.stages.iter().map(|s| s.total).sum();
        let done: usize = self.stages.iter().map(|s| s.done).sum();
        let running: usize = self.stages.iter().map(|s| s.running).sum();
        let mut line = format!(
            "job {} · tasks {done}/{total} ({running} running)",
            self.job
        );
        for (id, stage) in self.stages.iter().enumerate() {
            let _ = write!(line, " · s{id} {}/{}", stage.done, stage.total);
            if stage.rows > 0 {
                let _ = write!(line, " {} rows", compact(stage.rows));
            }
        }
        match self.retries {
            0 => {}
            1 => line.push_str(" · 1 region retried"),
            n => {
                let _ = write!(line, " · {n} regions retried");
            }
        }
        line
    }
}

/// One line for all running jobs, or `None` when nothing runs.
pub fn progress_line(jobs: &[JobProgress]) -> Option<String> {
    let lines: Vec<String> = jobs.iter().map(JobProgress::line).collect();
    (!lines.is_empty()).then(|| lines.join(" | "))
}

fn compact(n: u64) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=9_999_999 => format!("{:.1}k", n as f64 / 1e3),
        _ => format!("{:.1}M", n as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_sums_tasks_and_shows_rows() {
        let progress = JobProgress {
            job: 3,
            stages: vec![
                StageProgress {
                    total: 4,
                    running: 0,
                    done: 4,
                    rows: 12_000,
                },
                StageProgress {
                    total: 1,
                    running: 1,
                    done: 0,
                    rows: 0,
                },
            ],
            retries: 0,
            label: None,
        };
        assert_eq!(
            progress.line(),
            "job 3 · tasks 4/5 (1 running) · s0 4/4 12.0k rows · s1 0/1"
        );
        let retried = JobProgress {
            retries: 2,
            ..progress
        };
        assert!(
            retried.line().ends_with("s1 0/1 · 2 regions retried"),
            "{}",
            retried.line()
        );
    }
}
