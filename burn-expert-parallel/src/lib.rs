//! # burn-expert-parallel
//!
//! Mixture of Experts with expert parallelism, as Megatron-Core's `transformer/moe` does it: a
//! router picks each token's top-k experts (softmax in fp32, with the Switch/GShard
//! load-balancing loss and the optional router z-loss), and a dispatcher sends each token's
//! copies to the ranks holding those experts with an all-to-all, runs every local expert on all
//! the rows it received, and brings the outputs back weighted by the router. Everything is
//! differentiated, so a model built on it trains under burn's `Autodiff`.
//!
//! | file | what |
//! |---|---|
//! | [`router`] | [`RouterConfig`], [`route`]: top-k, aux loss, z-loss, capacity |
//! | [`dispatcher`] | [`ExpertParallel`], [`dispatch_combine`]: sort, exchange counts, all-to-all (uneven or padded), experts, back, combine |
//! | [`moe`] | [`Moe`]: a router and SwiGLU experts, this rank's share of them |

pub mod dispatcher;
mod error;
pub mod moe;
pub mod router;

pub use dispatcher::{Dispatch, DispatchStats, ExpertParallel, Routing, dispatch_combine};
pub use error::MoeError;
pub use moe::{Moe, MoeOutput};
pub use router::{Routed, RouterConfig, route};
