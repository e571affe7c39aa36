//! The cluster protocol generated from `proto/sluice.proto`: task definitions, stream tickets, and the
//! `DriverService` and `WorkerService` gRPC services.

#![allow(missing_docs, clippy::all)]

tonic::include_proto!("sluice.cluster");
