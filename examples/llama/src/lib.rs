//! # llama
//!
//! A Llama-style Transformer trained with any mix of data, tensor and pipeline parallelism and
//! ZeRO: the main job of burn-parallel.
//!
//! Not implemented yet: this example is empty until its issue lands. Nothing here pretends to
//! work.
