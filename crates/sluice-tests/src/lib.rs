//! Sluice's cross-crate tests live in `tests/`: every distributed mode against local mode (TPC-H, the
//! distributed-correctness rewrites, a property test over random queries), the cluster's retries and
//! fault paths, cancellation under load. This library is empty; `tests/common` holds the helpers.
