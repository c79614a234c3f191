//! Running one function on every rank of a world, as threads of this process.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use crate::local::Group;
use crate::mesh::DeviceMesh;
use crate::sync::panic_message;
use crate::world::{RankStatus, World};
use crate::{CommError, Communicator};

/// The timeout of a collective when neither the code nor `BURN_COMM_TIMEOUT_SECS` sets one:
/// long enough for a slow first step (compilation, autotuning), short enough to end a hang.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How to launch a world of ranks.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Number of ranks.
    pub world_size: usize,
    /// How long a rank waits for its peers in one call before the call fails.
    pub timeout: Duration,
}

impl LaunchConfig {
    /// `world_size` ranks, with the timeout of `BURN_COMM_TIMEOUT_SECS` or [`DEFAULT_TIMEOUT`].
    pub fn new(world_size: usize) -> Self {
        let timeout = std::env::var("BURN_COMM_TIMEOUT_SECS")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(DEFAULT_TIMEOUT);
        Self {
            world_size,
            timeout,
        }
    }

    /// Sets the per-call timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// What a rank's function is given: its rank and its communicator on the whole world.
#[derive(Debug, Clone)]
pub struct RankContext {
    world: Communicator,
    local_rank: usize,
}

impl RankContext {
    pub(crate) fn new(world: Communicator, local_rank: usize) -> Self {
        Self { world, local_rank }
    }

    /// This rank's index among the ranks on its machine, which by torchrun's convention is the
    /// GPU it drives: the launcher's `LOCAL_RANK` (or MPI's local rank) for a process, the rank
    /// itself for a thread of [`launch`].
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// This rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// The number of ranks launched.
    pub fn world_size(&self) -> usize {
        self.world.size()
    }

    /// The communicator of the whole world.
    pub fn world(&self) -> &Communicator {
        &self.world
    }

    /// Builds a device mesh over the world; see [`DeviceMesh::new`].
    pub fn mesh(&self, dims: &[(&str, usize)]) -> Result<DeviceMesh, CommError> {
        DeviceMesh::new(&self.world, dims)
    }
}

/// How a rank ended without a result.
#[derive(Debug, thiserror::Error)]
pub enum RankError<E> {
    /// The rank's function returned an error.
    #[error("rank {rank} returned an error: {error}")]
    Failed {
        /// The rank.
        rank: usize,
        /// Its error.
        error: E,
    },
    /// The rank's function panicked.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
}

/// Runs `f` on `world_size` ranks, each a thread of this process, and returns every rank's
/// result in rank order. See [`launch_with`].
pub fn launch<T, E, F>(world_size: usize, f: F) -> Vec<Result<T, RankError<E>>>
where
    F: Fn(RankContext) -> Result<T, E> + Sync,
    T: Send,
    E: fmt::Display + Send,
{
    launch_with(LaunchConfig::new(world_size), f)
}

/// Runs `f` on every rank of `config`, each a thread of this process, and returns every rank's
/// result in rank order.
///
/// A rank that panics or returns an error never leaves its peers hanging: every peer blocked in a
/// call waiting for it gets [`CommError::PeerFailed`] naming it.
///
/// # Panics
/// If `config.world_size` is 0.
pub fn launch_with<T, E, F>(config: LaunchConfig, f: F) -> Vec<Result<T, RankError<E>>>
where
    F: Fn(RankContext) -> Result<T, E> + Sync,
    T: Send,
    E: fmt::Display + Send,
{
    assert!(
        config.world_size > 0,
        "launch needs a world of at least one rank"
    );
    let world = World::new(config.world_size, config.timeout);
    let group = Group::root(
        &world,
        "world".to_string(),
        (0..config.world_size).collect(),
    );
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..config.world_size)
            .map(|rank| {
                let context = RankContext::new(Communicator::new(group.clone(), rank), rank);
                let world = world.clone();
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let outcome = catch_unwind(AssertUnwindSafe(|| f(context)));
                        let (status, result) = match outcome {
                            Ok(Ok(value)) => {
                                // Calls it left in flight still count as the rank being there.
                                world.wait_until_drained(rank);
                                (RankStatus::Returned, Ok(value))
                            }
                            Ok(Err(error)) => (
                                RankStatus::Failed(format!("returned an error: {error}")),
                                Err(RankError::Failed { rank, error }),
                            ),
                            Err(panic) => {
                                let message = panic_message(panic.as_ref());
                                (
                                    RankStatus::Failed(format!("panicked: {message}")),
                                    Err(RankError::Panicked { rank, message }),
                                )
                            }
                        };
                        world.set_status(rank, status);
                        result
                    })
                    .expect("the OS refused to start a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank threads catch their panics"))
            .collect()
    })
}
