//! Input-key expansion: which producer streams a consumer task reads for each input partition.
//!
//! A producer stage with `P` partitions writes `C` channels per task, each kept in `R` replicas
//! (`JobGraph::replicas`). The consumer's `StageInputExec` has some number of partitions; whenever
//! consumer task `t` executes input partition `i`, it reads these streams, in this order:
//!
//! ```text
//!  Forward    i = producer partition      (i, every channel, replica 0)
//!  Shuffle    i = channel                 (every producer partition q, i, replica 0)
//!  Broadcast  i = channel                 (every producer partition q, i, replica t)
//!  Merge      i = producer partition      (i, every channel, replica t)
//!  Rescale    i of M                      (q in [i*P/M, (i+1)*P/M), every channel, replica 0)
//! ```
//!
//! Enumerated over all `i`, Shuffle lists channels in the outer loop and producer partitions in the
//! inner one: that is the exchange. `Merge` and `Broadcast` are read by every consumer task, so each
//! task reads its own replica; every other stream is read by exactly one task.

use datafusion::common::{Result, plan_err};

use super::InputMode;
use crate::ids::InputKey;
use crate::plan::rescale::rescale_range;

/// The streams consumer task `task` reads for each partition of an input in `mode` from a producer
/// with `producer_partitions` partitions and `producer_channels` channels, whose placeholder has
/// `input_partitions` partitions. Element `i` lists the streams of input partition `i`.
pub fn task_input_keys(
    mode: InputMode,
    producer_partitions: usize,
    producer_channels: usize,
    input_partitions: usize,
    task: usize,
) -> Result<Vec<Vec<InputKey>>> {
    task_input_keys_of(
        mode,
        producer_partitions,
        producer_channels,
        input_partitions,
        task,
        0..input_partitions,
    )
}

/// [`task_input_keys`] for the input partitions in `wanted` only (element `k` lists the streams
/// of input partition `wanted.start + k`): a task that reads one partition costs one, not all.
pub fn task_input_keys_of(
    mode: InputMode,
    producer_partitions: usize,
    producer_channels: usize,
    input_partitions: usize,
    task: usize,
    wanted: std::ops::Range<usize>,
) -> Result<Vec<Vec<InputKey>>> {
    if wanted.end > input_partitions {
        return plan_err!(
            "input partitions {wanted:?} asked of an input with {input_partitions} partitions"
        );
    }
    let expected = match mode {
        InputMode::Forward | InputMode::Merge => Some(producer_partitions),
        InputMode::Shuffle | InputMode::Broadcast => Some(producer_channels),
        InputMode::Rescale => None,
    };
    if let Some(expected) = expected.filter(|e| *e != input_partitions) {
        return plan_err!(
            "a {} input of a producer with {producer_partitions} partitions and {producer_channels} channels has {expected} partitions, not {input_partitions}",
            mode.name()
        );
    }
    if mode == InputMode::Rescale && input_partitions > producer_partitions.max(1) {
        return plan_err!(
            "a Rescale input cannot widen {producer_partitions} producer partitions to {input_partitions}"
        );
    }
    let key = |partition, channel, replica| InputKey {
        partition,
        channel,
        replica,
    };
    let keys = wanted
        .map(|i| match mode {
            InputMode::Forward => (0..producer_channels).map(|c| key(i, c, 0)).collect(),
            InputMode::Merge => (0..producer_channels).map(|c| key(i, c, task)).collect(),
            InputMode::Shuffle => (0..producer_partitions).map(|q| key(q, i, 0)).collect(),
            InputMode::Broadcast => (0..producer_partitions).map(|q| key(q, i, task)).collect(),
            InputMode::Rescale => rescale_range(i, input_partitions, producer_partitions)
                .flat_map(|q| (0..producer_channels).map(move |c| key(q, c, 0)))
                .collect(),
        })
        .collect();
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(keys: &[InputKey]) -> Vec<(usize, usize, usize)> {
        keys.iter()
            .map(|k| (k.partition, k.channel, k.replica))
            .collect()
    }

    #[test]
    fn the_keys_of_some_partitions_equal_those_of_every_partition_at_the_same_places() {
        for mode in [
            InputMode::Forward,
            InputMode::Merge,
            InputMode::Shuffle,
            InputMode::Broadcast,
            InputMode::Rescale,
        ] {
            let (partitions, channels) = match mode {
                InputMode::Shuffle | InputMode::Broadcast => (6, 4),
                InputMode::Rescale => (6, 1),
                _ => (4, 2),
            };
            let every = task_input_keys(mode, partitions, channels, 4, 2).unwrap();
            let some = task_input_keys_of(mode, partitions, channels, 4, 2, 1..3).unwrap();
            assert_eq!(some, every[1..3], "{mode:?}");
        }
        assert!(task_input_keys_of(InputMode::Forward, 4, 1, 4, 0, 3..5).is_err());
    }

    #[test]
    fn forward_reads_the_same_partition() {
        let keys = task_input_keys(InputMode::Forward, 3, 1, 3, 1).unwrap();
        assert_eq!(pairs(&keys[1]), [(1, 0, 0)]);
        assert_eq!(keys.len(), 3);
    }

    #[test]
    fn shuffle_reads_one_channel_of_every_producer_channels_outer() {
        let keys = task_input_keys(InputMode::Shuffle, 3, 2, 2, 0).unwrap();
        let flat: Vec<_> = keys.iter().flat_map(|k| pairs(k)).collect();
        assert_eq!(
            flat,
            [
                (0, 0, 0),
                (1, 0, 0),
                (2, 0, 0),
                (0, 1, 0),
                (1, 1, 0),
                (2, 1, 0)
            ]
        );
        // Every (partition, channel) is read exactly once across the consumer partitions.
        let mut sorted = flat.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 6);
    }

    #[test]
    fn broadcast_reads_everything_from_the_task_replica() {
        let keys = task_input_keys(InputMode::Broadcast, 3, 1, 1, 2).unwrap();
        assert_eq!(pairs(&keys[0]), [(0, 0, 2), (1, 0, 2), (2, 0, 2)]);
    }

    #[test]
    fn merge_reads_each_producer_partition_as_its_own_input_partition() {
        let keys = task_input_keys(InputMode::Merge, 3, 1, 3, 1).unwrap();
        assert_eq!(
            keys.iter().map(|k| pairs(k)).collect::<Vec<_>>(),
            [vec![(0, 0, 1)], vec![(1, 0, 1)], vec![(2, 0, 1)]]
        );
    }

    #[test]
    fn rescale_reads_contiguous_ranges() {
        let keys = task_input_keys(InputMode::Rescale, 5, 1, 2, 0).unwrap();
        assert_eq!(pairs(&keys[0]), [(0, 0, 0), (1, 0, 0)]);
        assert_eq!(pairs(&keys[1]), [(2, 0, 0), (3, 0, 0), (4, 0, 0)]);
    }

    #[test]
    fn mismatched_partition_counts_are_planning_errors() {
        assert!(task_input_keys(InputMode::Shuffle, 3, 4, 3, 0).is_err());
        assert!(task_input_keys(InputMode::Forward, 3, 1, 2, 0).is_err());
        assert!(task_input_keys(InputMode::Rescale, 2, 1, 3, 0).is_err());
    }
}
