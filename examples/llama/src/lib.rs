//! # llama
//!
//! A Llama-style decoder (RMSNorm, rotary positions in Hugging Face's layout, grouped-query
//! causal attention, SwiGLU, untied head) and its trainer, the main job of burn-parallel:
//! the same run on one device, data-parallel over many ranks or tensor-parallel within each
//! replica, with the same losses.

pub mod batches;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod data;
pub mod dims;
pub mod engine;
pub mod experts;
pub mod hf;
pub mod hf_config;
pub mod interrupt;
pub mod launch;
pub mod model;
pub mod parallel_plan;
pub mod pipeline;
pub mod plan;
pub mod planner;
pub mod rope;
pub mod run;
pub mod safetensors_files;
pub mod schedule;
pub mod token_cache;
pub mod tokenizer;
pub mod train;
pub mod weights;

pub use config::LlamaConfig;
pub use model::Llama;
