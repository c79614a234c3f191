//! # burn-tensor-parallel
//!
//! Megatron-style tensor parallelism for burn: column and row parallel linears, vocab-parallel
//! embedding and cross-entropy, head-sharded attention, sequence parallelism. It will build on
//! the autodiff-aware region operations of `burn_comm::parallel`.
//!
//! Not implemented yet: this crate is empty until its issue lands. Nothing here pretends to
//! work.
