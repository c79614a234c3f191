//! One program per rank: a process learns its rank context from the launcher that started it
//! (`mpirun`, `srun`, or `burn-launch --mpi`, which starts the ranks through `mpirun`), and
//! runs the same per-rank function that [`launch`](crate::launch) runs on threads.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::CommError;
use crate::launch::RankContext;
use crate::sync::panic_message;

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
    },
    /// torchrun's variables (`RANK`, `WORLD_SIZE`, ...) without an MPI launcher's: torchrun,
    /// or `burn-launch` for NCCL.
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
        for (rank, size) in mpi {
            if lookup(rank).is_some() {
                return Launcher::Mpi {
                    rank: number(rank),
                    world_size: number(size),
                };
            }
        }
        if lookup("RANK").is_some() && lookup("WORLD_SIZE").is_some() {
            return Launcher::Torchrun;
        }
        Launcher::Alone
    }
}

/// This process's rank in a job of several processes, with MPI kept up until it ends.
///
/// ```no_run
/// # fn train(ctx: burn_comm::RankContext) -> Result<(), burn_comm::CommError> { Ok(()) }
/// // Under `mpirun -n 4 prog`: one process per rank. Started alone: four threads.
/// match burn_comm::Process::from_env().expect("a valid launch") {
///     Some(process) => process.run(train),
///     None => burn_comm::launch(4, train).into_iter().for_each(|r| r.unwrap()),
/// }
/// ```
pub struct Process {
    context: RankContext,
    /// Declared last: MPI is finalised after the world is dropped.
    #[cfg(feature = "mpi")]
    _session: crate::mpi::Session,
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
    /// the ranks as threads with [`launch`](crate::launch) then). MPI is initialised here and
    /// finalised when the `Process` is dropped; the collectives' timeout is
    /// `BURN_COMM_TIMEOUT_SECS` (see [`LaunchConfig::new`](crate::LaunchConfig::new)).
    ///
    /// Refused with a sentence: an MPI launch of a program built without the `mpi` feature
    /// (each process would silently run the whole job alone), torchrun's variables without
    /// MPI's (CPU ranks meet through MPI: start them with `mpirun` or `burn-launch --mpi`), and a
    /// world that MPI sees otherwise than the launcher.
    pub fn from_env() -> Result<Option<Self>, CommError> {
        match Launcher::from_env() {
            Launcher::Alone => Ok(None),
            Launcher::Torchrun => Err(CommError::Config(
                "this process was started with torchrun's variables (RANK, WORLD_SIZE) but not by an MPI launcher: CPU ranks meet through MPI, so start them with `burn-launch --mpi --nproc-per-node N -- PROG` (which starts them through mpirun) or `mpirun -n N PROG`; for CUDA ranks on NCCL, use `Communicator::nccl_world`".into(),
            )),
            Launcher::Mpi { rank, world_size } => Self::join_mpi(rank, world_size).map(Some),
        }
    }

    #[cfg(not(feature = "mpi"))]
    fn join_mpi(_rank: Option<usize>, _world_size: Option<usize>) -> Result<Self, CommError> {
        Err(CommError::Config(
            "this program was started by an MPI launcher (mpirun, srun), but built without burn-comm's `mpi` feature, so each process would run the whole job alone; rebuild it with `--features mpi` (Open MPI: apt-get install libopenmpi-dev openmpi-bin libclang-dev)".into(),
        ))
    }

    #[cfg(feature = "mpi")]
    fn join_mpi(rank: Option<usize>, world_size: Option<usize>) -> Result<Self, CommError> {
        use crate::{Communicator, LaunchConfig};
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
            context: RankContext::new(Communicator::new(world, mpi_rank)),
            _session: session,
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
    /// `rank R panicked: message`) and aborts every process, so no peer waits for it.
    pub fn run<T, E, F>(self, f: F) -> T
    where
        F: FnOnce(RankContext) -> Result<T, E>,
        E: fmt::Display,
    {
        let Self {
            context,
            #[cfg(feature = "mpi")]
            _session,
        } = self;
        let rank = context.rank();
        let message = match catch_unwind(AssertUnwindSafe(|| f(context))) {
            Ok(Ok(value)) => return value,
            Ok(Err(error)) => format!("rank {rank} failed: {error}"),
            Err(panic) => format!("rank {rank} panicked: {}", panic_message(panic.as_ref())),
        };
        end_job(&message)
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

/// Prints `message` and ends every process of the job.
fn end_job(message: &str) -> ! {
    #[cfg(feature = "mpi")]
    crate::mpi::abort(message);
    #[cfg(not(feature = "mpi"))]
    {
        eprintln!("{message}");
        std::process::exit(1)
    }
}

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
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
            ])),
            Launcher::Mpi {
                rank: Some(1),
                world_size: Some(4)
            }
        );
        assert_eq!(
            Launcher::from_lookup(lookup(&[("PMIX_RANK", "0")])),
            Launcher::Mpi {
                rank: Some(0),
                world_size: None
            }
        );
        assert_eq!(
            Launcher::from_lookup(lookup(&[("RANK", "0"), ("WORLD_SIZE", "2")])),
            Launcher::Torchrun
        );
    }
}
