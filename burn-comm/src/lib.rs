//! # burn-comm
//!
//! Ranks, groups, a device mesh and the collectives of `torch.distributed` on burn tensors,
//! for any burn backend.
//!
//! ```
//! use burn::backend::Flex;
//! use burn::tensor::Tensor;
//! use burn_comm::{launch, ReduceOp};
//!
//! let results = launch(2, |ctx| {
//!     let x = Tensor::<Flex, 1>::from_floats([ctx.rank() as f32 + 1.0], &Default::default());
//!     let sum = ctx.world().all_reduce(x, ReduceOp::Sum)?;
//!     Ok::<_, burn_comm::CommError>(sum.into_scalar())
//! });
//! assert!(results.into_iter().all(|r| r.unwrap() == 3.0));
//! ```
//!
//! Layers, bottom up: the local transport ([`launch`] runs ranks as threads that exchange data
//! through shared memory), the [`Communicator`] of one rank in one group, the [`DeviceMesh`] of
//! named dimensions, and the autodiff-aware operations of tensor parallelism in [`parallel`].
//! For jobs of several processes: [`ProcessEnv`] reads the torchrun environment (as set by
//! `burn-launch`) and [`Store`] is the TCP key-value store through which they meet.

mod all_to_all_split;
mod call;
mod collective_matmul;
mod communicator;
#[cfg(any(feature = "cuda", test))]
mod device_layout;
mod env;
mod error;
mod kernels;
mod launch;
mod local;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nccl_p2p;
#[cfg(feature = "cuda")]
mod nccl_tensor;
#[cfg(any(feature = "cuda", test))]
mod pair_ids;
pub mod parallel;
mod process;
mod ring_attention;
mod shared;
mod stats;
mod store;
mod sync;
mod tcp;
mod transport;
mod uneven;
mod world;

pub use call::ReduceOp;
pub use communicator::{Communicator, Work};
pub use env::{ProcessEnv, Rendezvous};
pub use error::CommError;
pub use launch::{DEFAULT_TIMEOUT, LaunchConfig, RankContext, RankError, launch, launch_with};
pub use mesh::DeviceMesh;
pub use process::{Launcher, Process, mpirun};
pub use stats::{CommStats, OpStats};
pub use store::{Store, StoreError, StoreServer};
