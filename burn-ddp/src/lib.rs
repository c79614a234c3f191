//! # burn-ddp
//!
//! Data parallelism for burn: `DistributedDataParallel` (bucketed, overlapped gradient
//! all-reduce, `no_sync`, `DistributedSampler`) and the parameter-server `DataParallel` baseline.
//!
//! Not implemented yet: this crate is empty until its issue lands. Nothing here pretends to
//! work.
