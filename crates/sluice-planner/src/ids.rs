//! Every identity type of Sluice, in one place: what names a job, a stage, a task, a task attempt,
//! a region, a worker and an output stream.
//!
//! ```text
//!   JobId ─┬─ StageId ── TaskId {stage, partition} ── TaskAttempt {task, attempt}
//!          │                                               │
//!          └──────────────── AttemptKey {job, stage, partition, attempt}      (one attempt of one job)
//!                               └─ TaskStreamKey {job, stage, partition, attempt, channel}
//!                                     └─ StreamId {stream, replica}          (what one reader takes)
//!   InputKey {partition, channel, replica}: a producer stream as seen from its consumer stage
//!   RegionId: tasks scheduled together · WorkerId: a registered worker (0 is the driver's executor)
//! ```
//!
//! All are small `Copy` values; `Display` names them the way errors and logs do ("job 3 stage 1
//! partition 0 attempt 2").

use std::fmt;

/// A job's id, unique within one driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A stage's index in its job graph (also its position in topological order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StageId(pub usize);

impl fmt::Display for StageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One task: a partition of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId {
    /// The stage.
    pub stage: StageId,
    /// The partition.
    pub partition: usize,
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stage {} partition {}", self.stage, self.partition)
    }
}

/// A region's index in its topology (also its position in dependency order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub usize);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A registered worker; the driver's own executor is worker 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u64);

impl WorkerId {
    /// The driver's own executor.
    pub const DRIVER: WorkerId = WorkerId(0);
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::DRIVER {
            write!(f, "the driver")
        } else {
            write!(f, "worker {}", self.0)
        }
    }
}

/// One attempt of one task, within a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskAttempt {
    /// The task.
    pub task: TaskId,
    /// The attempt (0 for the first; the region's attempt when it was started).
    pub attempt: usize,
}

impl TaskAttempt {
    /// This attempt of `job`.
    pub fn of_job(self, job: JobId) -> AttemptKey {
        AttemptKey {
            job,
            stage: self.task.stage,
            partition: self.task.partition,
            attempt: self.attempt,
        }
    }
}

/// One task attempt of one job: what a worker runs and reports about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttemptKey {
    /// The job.
    pub job: JobId,
    /// The stage.
    pub stage: StageId,
    /// The partition.
    pub partition: usize,
    /// The attempt.
    pub attempt: usize,
}

impl AttemptKey {
    /// The task.
    pub fn task(&self) -> TaskId {
        TaskId {
            stage: self.stage,
            partition: self.partition,
        }
    }

    /// The attempt within its job.
    pub fn task_attempt(&self) -> TaskAttempt {
        TaskAttempt {
            task: self.task(),
            attempt: self.attempt,
        }
    }

    /// Output channel `channel` of this attempt.
    pub fn stream(&self, channel: usize) -> TaskStreamKey {
        TaskStreamKey {
            job: self.job,
            stage: self.stage,
            partition: self.partition,
            attempt: self.attempt,
            channel,
        }
    }
}

impl fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {} stage {} partition {} attempt {}",
            self.job, self.stage, self.partition, self.attempt
        )
    }
}

/// One output channel of one task attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskStreamKey {
    /// The job.
    pub job: JobId,
    /// The producer stage.
    pub stage: StageId,
    /// The producer partition.
    pub partition: usize,
    /// The task attempt.
    pub attempt: usize,
    /// The output channel.
    pub channel: usize,
}

impl TaskStreamKey {
    /// The attempt that writes this stream.
    pub fn attempt_key(&self) -> AttemptKey {
        AttemptKey {
            job: self.job,
            stage: self.stage,
            partition: self.partition,
            attempt: self.attempt,
        }
    }

    /// Replica `replica` of this stream (what one reader takes).
    pub fn replica(self, replica: usize) -> StreamId {
        StreamId {
            stream: self,
            replica,
        }
    }
}

impl fmt::Display for TaskStreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {} stage {} partition {} attempt {} channel {}",
            self.job, self.stage, self.partition, self.attempt, self.channel
        )
    }
}

/// What one reader takes: a replica of one output channel (every reader of a replicated output
/// reads its own replica).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    /// The output channel.
    pub stream: TaskStreamKey,
    /// The replica.
    pub replica: usize,
}

impl StreamId {
    /// The attempt that writes this stream.
    pub fn attempt_key(&self) -> AttemptKey {
        self.stream.attempt_key()
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {} replica {}", self.stream, self.replica)
    }
}

/// One producer output stream as its consumer stage names it: a task's partition, one of its
/// channels, one replica of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InputKey {
    /// Producer partition.
    pub partition: usize,
    /// Channel of that partition's output.
    pub channel: usize,
    /// Replica of that channel.
    pub replica: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_themselves_as_errors_do() {
        let key = AttemptKey {
            job: JobId(3),
            stage: StageId(1),
            partition: 0,
            attempt: 2,
        };
        assert_eq!(key.to_string(), "job 3 stage 1 partition 0 attempt 2");
        assert_eq!(
            key.stream(4).replica(1).to_string(),
            "stream job 3 stage 1 partition 0 attempt 2 channel 4 replica 1"
        );
        assert_eq!(key.stream(4).attempt_key(), key);
        assert_eq!(key.task_attempt().of_job(JobId(3)), key);
        assert_eq!(WorkerId(2).to_string(), "worker 2");
        assert_eq!(WorkerId::DRIVER.to_string(), "the driver");
    }
}
