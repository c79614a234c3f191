//! # burn-zero
//!
//! ZeRO for burn: flat sharded buffers, stages 1, 2 and 3, mixed precision, CPU offload and a
//! memory estimator.
//!
//! Not implemented yet: this crate is empty until its issue lands. Nothing here pretends to
//! work.
