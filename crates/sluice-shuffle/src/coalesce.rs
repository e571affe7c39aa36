//! Per-channel coalescing: small routed slices are gathered into batches of a target size.
//!
//! Each channel has an Arrow `BatchCoalescer`. A slice larger than half the target is passed through
//! without a copy (it is already a reasonable batch); smaller ones are copied into the channel's
//! in-progress batch. With a row limit, a channel stops accepting rows once it has emitted that many, so a
//! `LIMIT` above the shuffle does not pay for rows nobody reads. The remainder of every channel is flushed
//! by [`ChannelCoalescers::finish`].

use arrow::array::RecordBatch;
use arrow::compute::BatchCoalescer;
use arrow::datatypes::SchemaRef;
use datafusion_common::Result;
use datafusion_physical_plan::metrics::Time;

/// One `BatchCoalescer` per channel, plus an optional per-channel row limit.
#[derive(Debug)]
pub struct ChannelCoalescers {
    coalescers: Vec<BatchCoalescer>,
    accepted: Vec<usize>,
    limit: Option<usize>,
    time: Time,
}

impl ChannelCoalescers {
    /// Coalescers for `channels` channels producing `target_rows`-row batches.
    pub fn new(
        schema: SchemaRef,
        channels: usize,
        target_rows: usize,
        limit: Option<usize>,
        time: Time,
    ) -> Self {
        let target_rows = target_rows.max(1);
        let coalescers = (0..channels)
            .map(|_| {
                BatchCoalescer::new(schema.clone(), target_rows)
                    .with_biggest_coalesce_batch_size(Some(target_rows / 2))
            })
            .collect();
        Self {
            coalescers,
            accepted: vec![0; channels],
            limit,
            time,
        }
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.coalescers.len()
    }

    /// Whether `channel` has taken all the rows its limit allows.
    pub fn is_full(&self, channel: usize) -> bool {
        self.limit
            .is_some_and(|limit| self.accepted.get(channel).is_some_and(|&n| n >= limit))
    }

    /// Adds rows to `channel`, trimming them to the row limit. Out-of-range channels are an error.
    pub fn push(&mut self, channel: usize, batch: RecordBatch) -> Result<()> {
        let _timer = self.time.timer();
        let accepted = self.accepted.get_mut(channel).ok_or_else(|| {
            datafusion_common::DataFusionError::Internal(format!("channel {channel} out of range"))
        })?;
        let batch = match self.limit {
            Some(limit) if *accepted + batch.num_rows() > limit => {
                batch.slice(0, limit.saturating_sub(*accepted))
            }
            _ => batch,
        };
        if batch.num_rows() == 0 {
            return Ok(());
        }
        *accepted += batch.num_rows();
        self.coalescers[channel].push_batch(batch)?;
        Ok(())
    }

    /// Takes the next completed batch of any channel.
    pub fn next_completed(&mut self) -> Option<(usize, RecordBatch)> {
        self.coalescers
            .iter_mut()
            .enumerate()
            .find_map(|(channel, c)| c.next_completed_batch().map(|b| (channel, b)))
    }

    /// Flushes every channel's remainder; completed batches are then available.
    pub fn finish(&mut self) -> Result<()> {
        let _timer = self.time.timer();
        for coalescer in &mut self.coalescers {
            coalescer.finish_buffered_batch()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::Int32Array;
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("a", DataType::Int32, false)]))
    }

    fn rows(n: i32) -> RecordBatch {
        RecordBatch::try_new(schema(), vec![Arc::new(Int32Array::from_iter_values(0..n))]).unwrap()
    }

    fn drain(c: &mut ChannelCoalescers) -> Vec<(usize, usize)> {
        std::iter::from_fn(|| c.next_completed())
            .map(|(ch, b)| (ch, b.num_rows()))
            .collect()
    }

    #[test]
    fn small_slices_coalesce_to_the_target_and_the_rest_flushes() {
        let mut c = ChannelCoalescers::new(schema(), 2, 100, None, Time::new());
        for _ in 0..25 {
            c.push(0, rows(10)).unwrap();
        }
        c.push(1, rows(7)).unwrap();
        assert_eq!(drain(&mut c), vec![(0, 100), (0, 100)]);
        c.finish().unwrap();
        assert_eq!(drain(&mut c), vec![(0, 50), (1, 7)]);
    }

    #[test]
    fn big_slices_pass_through() {
        let mut c = ChannelCoalescers::new(schema(), 1, 100, None, Time::new());
        c.push(0, rows(80)).unwrap();
        c.finish().unwrap();
        assert_eq!(drain(&mut c), vec![(0, 80)]);
    }

    #[test]
    fn row_limit_caps_each_channel() {
        let mut c = ChannelCoalescers::new(schema(), 2, 100, Some(15), Time::new());
        c.push(0, rows(10)).unwrap();
        c.push(0, rows(10)).unwrap();
        c.push(0, rows(10)).unwrap();
        c.push(1, rows(3)).unwrap();
        assert!(c.is_full(0));
        assert!(!c.is_full(1));
        c.finish().unwrap();
        assert_eq!(drain(&mut c), vec![(0, 15), (1, 3)]);
    }

    #[test]
    fn unknown_channel_is_an_error() {
        let mut c = ChannelCoalescers::new(schema(), 1, 10, None, Time::new());
        assert!(c.push(3, rows(1)).is_err());
    }
}
