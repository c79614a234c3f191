//! # burn-checkpoint
//!
//! A checkpoint as PyTorch's distributed checkpoint and Megatron's `dist_checkpointing` keep
//! one: every rank hands in the pieces of tensors it holds, each a box at a global offset in its
//! tensor; a manifest records where every piece lies and its checksum; the whole is committed
//! atomically, so a crash at any moment leaves the previous checkpoint loadable; and any box of
//! any tensor can be read back, whatever layout wrote it (resharding).
//!
//! - [`region`]: boxes in a tensor, their overlaps, and a flat range cut into boxes (a ZeRO
//!   shard of a flattened parameter).
//! - [`manifest`]: what the manifest records.
//! - [`shard`]: the pieces a rank hands in, in host memory or read from a tensor as written.
//! - [`save`]: the collective save and its commit protocol.
//! - [`background`]: the same save in a thread of its own, while training goes on.
//! - [`load`]: opening a checkpoint (the latest committed one, or a given step) and reading any
//!   box of a tensor, checked.

pub mod background;
pub mod error;
pub mod load;
pub mod manifest;
pub mod region;
pub mod save;
pub mod shard;

pub use background::{BackgroundSaver, Saved};
pub use error::CheckpointError;
pub use load::Checkpoint;
pub use region::Region;
pub use save::{prune, save};
pub use shard::{Shard, ShardData};
