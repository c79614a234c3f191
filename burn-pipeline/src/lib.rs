//! # burn-pipeline
//!
//! Pipeline parallelism for burn: schedules as data (GPipe, 1F1B, interleaved 1F1B,
//! zero-bubble), validation, simulation, Gantt charts, stage split, an executor and activation
//! recompute.
//!
//! Not implemented yet: this crate is empty until its issue lands. Nothing here pretends to
//! work.
