//! One program per rank: a process learns its rank context from the launcher that started it
//! (`mpirun` or `srun`, whose ranks meet through MPI; `burn-launch` or torchrun, whose ranks meet
//! through the job's store and then talk over TCP), and runs the same per-rank function that
//! [`launch`](crate::launch) runs on threads.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::launch::RankContext;
use crate::sync::panic_message;
use crate::tcp::{Links, TcpGroup};
use crate::{CommError, Communicator, LaunchConfig, ProcessEnv, Rendezvous};

/// Which launcher started this process, read from its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launcher {
    /// Started alone: no launcher's variables are set.
    Alone,
    /// An MPI launcher (`mpirun`/`mpiexec` of Open MPI, `srun` with PMIx, or MPICH's hydra).
    Mpi {
        /// This process's rank, when the launcher says (Open MPI and MPICH do).
        rank: Option<usize>,
        /// The number of processes, when the launcher says.
        world_size: Option<usize>,
        /// This process's rank on its machine, when the launcher says (Open MPI, MPICH and
        /// Slurm do).
        local_rank: Option<usize>,
    },
    /// torchrun's variables (`RANK`, `WORLD_SIZE`, ...) without an MPI launcher's: torchrun,
    /// or `burn-launch` (on a CUDA machine, or with `--torchrun-env`).
    Torchrun,
}

impl Launcher {
    /// Reads the environment of this process.
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables from `lookup`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let number = |name: &str| lookup(name).and_then(|v| v.trim().parse::<usize>().ok());
        let mpi = [
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("PMI_RANK", "PMI_SIZE"),
            ("PMIX_RANK", "PMIX_SIZE"),
        ];
        let local = [
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "SLURM_LOCALID",
        ];
        for (rank, size) in mpi {
            if lookup(rank).is_some() {
                return Launcher::Mpi {
                    rank: number(rank),
                    world_size: number(size),
                    local_rank: local.into_iter().find_map(number),
                };
            }
        }
        if lookup("RANK").is_some() && lookup("WORLD_SIZE").is_some() {
            return Launcher::Torchrun;
        }
        Launcher::Alone
    }
}

/// This process's rank in a job of several processes, with what joins it to the others (MPI,
/// or the TCP transport's connections and store) kept up until it ends.
///
/// ```no_run
/// # fn train(ctx: burn_comm::RankContext) -> Result<(), burn_comm::CommError> { Ok(()) }
/// // Under `mpirun -n 4 prog` or `burn-launch --nproc-per-node 4 -- prog`: one process per
/// // rank. Started alone: four threads.
/// match burn_comm::Process::from_env().expect("a valid launch") {
///     Some(process) => process.run(train),
///     None => burn_comm::launch(4, train).into_iter().for_each(|r| r.unwrap()),
/// }
/// ```
pub struct Process {
    context: RankContext,
    /// Declared last: kept until the world is dropped.
    job: Job,
}

/// What joins a process to the others of its job.
enum Job {
    /// MPI, finalised when dropped.
    #[cfg(feature = "mpi")]
    Mpi { _session: crate::mpi::Session },
    /// The TCP transport.
    Tcp(TcpJob),
}

/// The TCP transport's connections, and the job's store, which rank 0 serves until every rank
/// has hung up.
struct TcpJob {
    links: Arc<Links>,
    rendezvous: Option<Rendezvous>,
}

impl Drop for TcpJob {
    fn drop(&mut self) {
        if let Some(rendezvous) = self.rendezvous.take() {
            // A rank that does not hang up in time has failed, and says so itself.
            let _ = rendezvous.depart();
        }
    }
}

impl Job {
    /// Ends every process of the job after rank `rank` failed (`reason`: "panicked: ...").
    fn end(self, rank: usize, reason: &str) -> ! {
        let message = format!("rank {rank} {reason}");
        match self {
            #[cfg(feature = "mpi")]
            Job::Mpi { .. } => crate::mpi::abort(&message),
            Job::Tcp(tcp) => {
                // The peers' calls fail naming this cause; the launcher stops the rest.
                tcp.links.abort(reason);
                eprintln!("{message}");
                std::process::exit(1)
            }
        }
    }
}

impl fmt::Debug for Process {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Process")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish()
    }
}

impl Process {
    /// Joins the job this process was started in: `Ok(None)` when it was started alone (run
    /// the ranks as threads with [`launch`](crate::launch) then). Under an MPI launcher, MPI is
    /// initialised here and finalised when the `Process` is dropped. Under torchrun's variables
    /// (see [`ProcessEnv`]), the ranks meet in the store rank 0 serves at `MASTER_ADDR:MASTER_PORT`
    /// and connect to each other over TCP; on CUDA, `ctx.world().nccl(&device)` then moves
    /// device tensors on NCCL, with the TCP world as its host group. The collectives' timeout
    /// is `BURN_COMM_TIMEOUT_SECS` (see [`LaunchConfig::new`]).
    ///
    /// Refused with a sentence: an MPI launch of a program built without the `mpi` feature
    /// (each process would silently run the whole job alone), torchrun's variables that are
    /// missing or out of range, ranks that do not meet within the timeout, and a world that MPI
    /// sees otherwise than the launcher.
    pub fn from_env() -> Result<Option<Self>, CommError> {
        match Launcher::from_env() {
            Launcher::Alone => Ok(None),
            Launcher::Torchrun => Self::join_tcp().map(Some),
            Launcher::Mpi {
                rank,
                world_size,
                local_rank,
            } => Self::join_mpi(rank, world_size, local_rank).map(Some),
        }
    }

    fn join_tcp() -> Result<Self, CommError> {
        let env = ProcessEnv::from_env()?;
        let timeout = LaunchConfig::new(1).timeout;
        let mut rendezvous = env.rendezvous(timeout).map_err(|e| {
            CommError::Config(format!(
                "rank {} of {} could not meet the others at {} (MASTER_ADDR:MASTER_PORT): {e}",
                env.rank,
                env.world_size,
                env.master()
            ))
        })?;
        let (world, links) = TcpGroup::world(&env, &mut rendezvous.store, timeout)?;
        Ok(Self {
            context: RankContext::new(Communicator::new(world, env.rank), env.local_rank),
            job: Job::Tcp(TcpJob {
                links,
                rendezvous: Some(rendezvous),
            }),
        })
    }

    #[cfg(not(feature = "mpi"))]
    fn join_mpi(
        _rank: Option<usize>,
        _world_size: Option<usize>,
        _local_rank: Option<usize>,
    ) -> Result<Self, CommError> {
        Err(CommError::Config(
            "this program was started by an MPI launcher (mpirun, srun), but built without burn-comm's `mpi` feature, so each process would run the whole job alone; rebuild it with `--features mpi` (Open MPI: apt-get install libopenmpi-dev openmpi-bin libclang-dev), or start it with `burn-launch --torchrun-env`".into(),
        ))
    }

    #[cfg(feature = "mpi")]
    fn join_mpi(
        rank: Option<usize>,
        world_size: Option<usize>,
        local_rank: Option<usize>,
    ) -> Result<Self, CommError> {
        let session = crate::mpi::Session::init().map_err(CommError::Config)?;
        let timeout = LaunchConfig::new(1).timeout;
        let world = crate::mpi::MpiGroup::world(timeout);
        let (mpi_rank, mpi_size) = (world.rank(), world.size());
        if rank.is_some_and(|r| r != mpi_rank) || world_size.is_some_and(|s| s != mpi_size) {
            return Err(CommError::Config(format!(
                "the launcher says rank {rank:?} of {world_size:?} but MPI says rank {mpi_rank} of {mpi_size}: the program was started by another MPI than the one it was built with"
            )));
        }
        Ok(Self {
            // A launcher that does not say is taken to start one process per machine.
            context: RankContext::new(Communicator::new(world, mpi_rank), local_rank.unwrap_or(0)),
            job: Job::Mpi { _session: session },
        })
    }

    /// This process's rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.context.rank()
    }

    /// The number of processes in the job.
    pub fn world_size(&self) -> usize {
        self.context.world_size()
    }

    /// The rank context [`run`](Process::run) gives its function.
    pub fn context(&self) -> &RankContext {
        &self.context
    }

    /// Runs `f` as this process's rank and returns its result. A rank whose function panics
    /// or returns an error ends the whole job at once: it prints `rank R failed: cause` (or
    /// `rank R panicked: message`) and ends every process (MPI aborts them; over TCP, the
    /// peers' calls fail naming this cause, and the launcher stops them), so no peer waits
    /// for it.
    pub fn run<T, E, F>(self, f: F) -> T
    where
        F: FnOnce(RankContext) -> Result<T, E>,
        E: fmt::Display,
    {
        let Self { context, job } = self;
        let rank = context.rank();
        let reason = match catch_unwind(AssertUnwindSafe(|| f(context))) {
            Ok(Ok(value)) => return value,
            Ok(Err(error)) => format!("failed: {error}"),
            Err(panic) => format!("panicked: {}", panic_message(panic.as_ref())),
        };
        job.end(rank, &reason)
    }
}

/// `mpirun -n ranks`, to which the caller adds mpirun's options and then the program, set up as
/// Open MPI needs it on a CPU machine: ranks may outnumber
/// the cores (`OMPI_MCA_rmaps_base_oversubscribe`), are not each pinned to one core (the default
/// binding would squeeze every rank's compute threads onto its core), and may run as root (as in
/// containers). Add `--hostfile FILE` for several machines.
pub fn mpirun(ranks: usize) -> std::process::Command {
    let mut command = std::process::Command::new("mpirun");
    command
        .arg("-n")
        .arg(ranks.to_string())
        .envs(MPIRUN_ENV.iter().copied());
    command
}

/// The environment [`mpirun`] sets.
const MPIRUN_ENV: [(&str, &str); 4] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
    ("OMPI_MCA_hwloc_base_binding_policy", "none"),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn tells_the_launcher_from_the_environment() {
        assert_eq!(Launcher::from_lookup(lookup(&[])), Launcher::Alone);
        assert_eq!(
            Launcher::from_lookup(lookup(&[
                ("OMPI_COMM_WORLD_RANK", "1"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
            ])),
            Launcher::Mpi {
                rank: Some(1),
                world_size: Some(4),
                local_rank: Some(1),
            }
        );
        assert_eq!(
            Launcher::from_lookup(lookup(&[("PMIX_RANK", "0"), ("SLURM_LOCALID", "2")])),
            Launcher::Mpi {
                rank: Some(0),
                world_size: None,
                local_rank: Some(2),
            }
        );
        assert_eq!(
            Launcher::from_lookup(lookup(&[("RANK", "0"), ("WORLD_SIZE", "2")])),
            Launcher::Torchrun
        );
    }
}
