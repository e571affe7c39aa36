//! Exactly-once job output under retries: what reached the caller from each final-stage stream,
//! and how a retried attempt's stream is matched against it. Pure code, no IO.
//!
//! ```text
//!   attempt 0 of task t, channel c:  [r0 r1 r2 r3] ──► caller        delivered(t, c) = 4 rows, sum S
//!   (its worker dies; the region runs again)
//!   attempt 1 of task t, channel c:  [r0 r1 r2 r3 | r4 r5 …]
//!                                     └ skipped, ┘  └ to the caller ┘
//!                                       summed to S' — S' == S, or the job fails
//! ```
//!
//! Invariants: a row reaches the caller at most once per stream, and only after every row before
//! it in that stream did; a retry may skip rows only after proving, with an order-sensitive checksum
//! of everything it skipped, that they are the rows the caller has; an attempt that ends inside the
//! skipped prefix, or differs from it, is an error naming the task — never a duplicate or a missing
//! row.

use std::collections::HashMap;

use datafusion::arrow::array::RecordBatch;
use datafusion::common::hash_utils::{RandomState, create_hashes};
use datafusion::common::{DataFusionError, Result};
use sluice_planner::{JobId, TaskAttempt, TaskId};

/// An order-sensitive checksum of a sequence of rows (`None`: a column type cannot be hashed, so
/// the sequence cannot be verified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Checksum(Option<u64>);

impl Default for Checksum {
    fn default() -> Self {
        Self(Some(0xcbf2_9ce4_8422_2325))
    }
}

impl Checksum {
    /// The checksum continued over `batch`'s rows, in order.
    pub(crate) fn update(self, batch: &RecordBatch) -> Self {
        let Some(mut sum) = self.0 else {
            return self;
        };
        let mut hashes = vec![0u64; batch.num_rows()];
        let state = RandomState::with_seed(0x51u64 << 56 | 0x1ce);
        if create_hashes(batch.columns(), &state, &mut hashes).is_err() {
            return Self(None);
        }
        for hash in hashes {
            sum = (sum ^ hash)
                .wrapping_mul(0x0000_0100_0000_01b3)
                .rotate_left(17);
        }
        Self(Some(sum))
    }
}

/// One stream of a final-stage task: which task, which output channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct StreamSlot {
    pub task: TaskId,
    pub channel: usize,
}

/// Rows of a stream so far and their checksum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Prefix {
    rows: usize,
    checksum: Checksum,
}

impl Prefix {
    fn extend(&mut self, batch: &RecordBatch) {
        self.rows += batch.num_rows();
        self.checksum = self.checksum.update(batch);
    }
}

/// What the caller has received per stream, and how far each retried attempt has replayed it.
#[derive(Debug, Default)]
pub(crate) struct DeliveredRows {
    delivered: HashMap<StreamSlot, Prefix>,
    /// An attempt still inside the prefix an earlier attempt delivered: its progress.
    replaying: HashMap<(TaskAttempt, usize), Prefix>,
    /// Attempts that passed their prefix (or had none): what they read goes to the caller.
    caught_up: HashMap<(TaskAttempt, usize), ()>,
    /// Retries that passed a non-empty prefix since the last `take_resumed`: (attempt, channel,
    /// rows skipped).
    resumed: Vec<(TaskAttempt, usize, usize)>,
}

impl DeliveredRows {
    /// The part of `batch` (read from `attempt`'s stream `channel`) that goes to the caller, after
    /// the rows the caller already has are skipped and checked; `None` when all of it was skipped.
    pub(crate) fn admit(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        channel: usize,
        batch: RecordBatch,
    ) -> Result<Option<RecordBatch>> {
        let slot = StreamSlot {
            task: attempt.task,
            channel,
        };
        let key = (attempt, channel);
        let delivered = self.delivered.get(&slot).copied().unwrap_or_default();
        let mut batch = batch;
        if !self.caught_up.contains_key(&key) {
            let progress = self.replaying.entry(key).or_default();
            let skip = (delivered.rows - progress.rows).min(batch.num_rows());
            if skip > 0 {
                progress.extend(&batch.slice(0, skip));
                batch = batch.slice(skip, batch.num_rows() - skip);
            }
            if progress.rows < delivered.rows {
                return Ok(None);
            }
            if progress.checksum != delivered.checksum || progress.checksum.0.is_none() {
                return Err(differs(job, attempt, delivered.rows, progress.checksum));
            }
            self.replaying.remove(&key);
            self.caught_up.insert(key, ());
            if delivered.rows > 0 {
                self.resumed.push((attempt, channel, delivered.rows));
            }
        }
        if batch.num_rows() == 0 {
            return Ok(None);
        }
        self.delivered.entry(slot).or_default().extend(&batch);
        Ok(Some(batch))
    }

    /// The retries that resumed a stream (skipped and checked its delivered rows) since the last
    /// call: (attempt, channel, rows skipped).
    pub(crate) fn take_resumed(&mut self) -> Vec<(TaskAttempt, usize, usize)> {
        std::mem::take(&mut self.resumed)
    }

    /// Checks, once `attempt`'s stream `channel` ended, that it reproduced everything the caller
    /// has from that stream.
    pub(crate) fn finish(&self, job: JobId, attempt: TaskAttempt, channel: usize) -> Result<()> {
        let key = (attempt, channel);
        if self.caught_up.contains_key(&key) {
            return Ok(());
        }
        let slot = StreamSlot {
            task: attempt.task,
            channel,
        };
        let delivered = self.delivered.get(&slot).copied().unwrap_or_default();
        let progress = self.replaying.get(&key).copied().unwrap_or_default();
        if delivered.rows == 0 {
            return Ok(());
        }
        Err(DataFusionError::Execution(format!(
            "job {job}: {} was retried after {} of its rows had reached the caller, and the \
             retry produced only {} rows: the query's result is not deterministic, so the job \
             fails rather than return missing or duplicate rows",
            attempt.task, delivered.rows, progress.rows
        )))
    }

    /// Rows the caller received in all.
    #[cfg(test)]
    pub(crate) fn total_rows(&self) -> usize {
        self.delivered.values().map(|p| p.rows).sum()
    }
}

fn differs(job: JobId, attempt: TaskAttempt, rows: usize, checksum: Checksum) -> DataFusionError {
    let why = if checksum.0.is_none() {
        "its rows cannot be checked (a column type has no hash), so Sluice cannot prove the retry \
         reproduced them"
            .to_string()
    } else {
        format!(
            "the retry produced different rows in that prefix: the query's result is not \
             deterministic (a LIMIT without ORDER BY, ties in the ORDER BY, a volatile \
             function), so the job fails rather than return missing or duplicate rows (attempt {})",
            attempt.attempt
        )
    };
    DataFusionError::Execution(format!(
        "job {job}: {} was retried after {rows} of its rows had reached the caller, and {why}",
        attempt.task
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::sync::Arc;

    use datafusion::arrow::array::{Int64Array, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use sluice_planner::StageId;

    use super::*;

    fn batch(values: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let strings: Vec<String> = values.iter().map(|v| format!("row {v}")).collect();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(values.to_vec())),
                Arc::new(StringArray::from(strings)),
            ],
        )
        .unwrap()
    }

    fn values(batch: &RecordBatch) -> Vec<i64> {
        batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .values()
            .to_vec()
    }

    fn attempt(attempt: usize) -> TaskAttempt {
        TaskAttempt {
            task: TaskId {
                stage: StageId(3),
                partition: 1,
            },
            attempt,
        }
    }

    const JOB: JobId = JobId(7);

    #[test]
    fn a_first_attempt_delivers_everything() {
        let mut rows = DeliveredRows::default();
        let out = rows.admit(JOB, attempt(0), 0, batch(&[1, 2, 3])).unwrap();
        assert_eq!(values(&out.unwrap()), [1, 2, 3]);
        rows.finish(JOB, attempt(0), 0).unwrap();
        assert_eq!(rows.total_rows(), 3);
    }

    #[test]
    fn a_retry_skips_exactly_the_delivered_rows_across_batch_boundaries() {
        let mut rows = DeliveredRows::default();
        rows.admit(JOB, attempt(0), 0, batch(&[1, 2])).unwrap();
        rows.admit(JOB, attempt(0), 0, batch(&[3])).unwrap();
        // The retry splits the same rows differently: [1] [2 3 4] [5].
        assert!(
            rows.admit(JOB, attempt(1), 0, batch(&[1]))
                .unwrap()
                .is_none()
        );
        let out = rows.admit(JOB, attempt(1), 0, batch(&[2, 3, 4])).unwrap();
        assert_eq!(values(&out.unwrap()), [4]);
        let out = rows.admit(JOB, attempt(1), 0, batch(&[5])).unwrap();
        assert_eq!(values(&out.unwrap()), [5]);
        rows.finish(JOB, attempt(1), 0).unwrap();
        assert_eq!(rows.total_rows(), 5);
    }

    #[test]
    fn a_retry_whose_prefix_differs_fails_naming_the_task() {
        let mut rows = DeliveredRows::default();
        rows.admit(JOB, attempt(0), 0, batch(&[1, 2, 3])).unwrap();
        // Same count, another order: not the rows the caller has.
        let error = rows
            .admit(JOB, attempt(1), 0, batch(&[1, 3, 2, 4]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "Execution error: job 7: stage 3 partition 1 was retried after 3 of its rows had \
             reached the caller, and the retry produced different rows in that prefix: the \
             query's result is not deterministic (a LIMIT without ORDER BY, ties in the ORDER \
             BY, a volatile function), so the job fails rather than return missing or duplicate \
             rows (attempt 1)"
        );
    }

    #[test]
    fn a_retry_that_ends_inside_the_prefix_fails() {
        let mut rows = DeliveredRows::default();
        rows.admit(JOB, attempt(0), 0, batch(&[1, 2, 3])).unwrap();
        assert!(
            rows.admit(JOB, attempt(1), 0, batch(&[1, 2]))
                .unwrap()
                .is_none()
        );
        let error = rows.finish(JOB, attempt(1), 0).unwrap_err().to_string();
        assert!(
            error.contains("retried after 3 of its rows had reached the caller, and the retry produced only 2 rows"),
            "{error}"
        );
    }

    #[test]
    fn channels_are_tracked_apart() {
        let mut rows = DeliveredRows::default();
        rows.admit(JOB, attempt(0), 0, batch(&[1, 2])).unwrap();
        rows.admit(JOB, attempt(0), 1, batch(&[10])).unwrap();
        let out = rows.admit(JOB, attempt(1), 1, batch(&[10, 11])).unwrap();
        assert_eq!(values(&out.unwrap()), [11]);
        let out = rows.admit(JOB, attempt(1), 0, batch(&[1, 2, 3])).unwrap();
        assert_eq!(values(&out.unwrap()), [3]);
        assert_eq!(rows.total_rows(), 5);
    }

    #[test]
    fn the_checksum_sees_order_and_content() {
        let sum = |v: &[i64]| Checksum::default().update(&batch(v));
        assert_eq!(sum(&[1, 2]), sum(&[1, 2]));
        assert_ne!(sum(&[1, 2]), sum(&[2, 1]));
        assert_ne!(sum(&[1, 2]), sum(&[1, 3]));
        let split = Checksum::default()
            .update(&batch(&[1]))
            .update(&batch(&[2]));
        assert_eq!(split, sum(&[1, 2]));
    }
}
