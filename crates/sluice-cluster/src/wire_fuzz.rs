//! Fuzzing of the cluster protocol's decoders ([`crate::wire`]): whatever bytes a peer sends as a
//! task definition, a status report or a stream ticket decode to a value or to one error naming
//! what was malformed, never a panic. Random bytes, and valid messages with bytes changed, cut off
//! or appended (most of which still parse as protobuf and so reach the field checks and the plan
//! decoder).
//!
//! proptest drives it: 256 cases per property by default (CI), more with `PROPTEST_CASES=N` (a
//! longer run). A failing input is saved under `proptest-regressions/` and replayed first on every
//! later run, so the inputs that found bugs stay as regression tests.

use datafusion::execution::TaskContext;
use proptest::collection::vec;
use proptest::prelude::*;
use prost::Message;

use crate::proto;
use crate::wire::tests::sample_definition;
use crate::wire::{decode_definition, encode_definition, report_from_proto, stream_from_ticket};

/// `bytes` with `edits` applied (each `(at, value)`: overwrite, insert or delete at `at`), then
/// cut to `keep` bytes.
fn mutate(mut bytes: Vec<u8>, edits: &[(usize, u8, u8)], keep: usize) -> Vec<u8> {
    for &(at, value, how) in edits {
        let at = at % (bytes.len() + 1);
        match how % 3 {
            0 if at < bytes.len() => bytes[at] = value,
            1 => bytes.insert(at, value),
            _ if at < bytes.len() => {
                bytes.remove(at);
            }
            _ => bytes.push(value),
        }
    }
    bytes.truncate(keep % (bytes.len() + 1));
    bytes
}

fn definition_bytes() -> Vec<u8> {
    encode_definition(&sample_definition()).unwrap()
}

proptest! {
    #[test]
    fn any_bytes_are_a_task_definition_or_an_error(bytes in vec(any::<u8>(), 0..512)) {
        if let Err(error) = decode_definition(&bytes, &TaskContext::default()) {
            prop_assert!(!error.to_string().is_empty());
        }
    }

    #[test]
    fn a_changed_task_definition_is_a_definition_or_an_error(
        edits in vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..6),
        keep in any::<usize>(),
    ) {
        let bytes = mutate(definition_bytes(), &edits, keep);
        if let Err(error) = decode_definition(&bytes, &TaskContext::default()) {
            prop_assert!(!error.to_string().is_empty());
        }
    }

    #[test]
    fn any_bytes_are_a_status_report_or_an_error(bytes in vec(any::<u8>(), 0..256)) {
        if let Ok(message) = proto::TaskStatusReport::decode(bytes.as_slice())
            && let Err(error) = report_from_proto(&message)
        {
            prop_assert!(error.to_string().contains("malformed cluster message"), "{error}");
        }
    }

    #[test]
    fn any_bytes_are_a_stream_ticket_or_an_error(bytes in vec(any::<u8>(), 0..128)) {
        if let Err(error) = stream_from_ticket(&bytes) {
            prop_assert!(error.to_string().contains("stream ticket"), "{error}");
        }
    }
}
