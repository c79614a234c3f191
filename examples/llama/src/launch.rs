//! Starting a run's ranks: as threads of this process, or as this process alone when the job
//! runs one process per rank; and turning the ranks' results into the run's.

use crate::dims::ParallelDims;
use crate::train::{StepMetrics, TrainConfig, TrainError};
use burn_comm::Communicator;

/// Refuses a job whose processes do not match the layout's ranks.
pub(crate) fn check_processes(config: &TrainConfig) -> Result<(), TrainError> {
    let Some(ctx) = &config.process else {
        return Ok(());
    };
    let dims = ParallelDims::of(config);
    let ranks = dims.ranks();
    if ctx.world_size() != ranks {
        return Err(TrainError::Config(format!(
            "this layout ({}) needs {ranks} ranks but the job has {} processes; start it with `mpirun -n {ranks}` or `burn-launch --nproc-per-node {ranks}`, or alone to run the ranks as threads",
            dims.describe(),
            ctx.world_size()
        )));
    }
    Ok(())
}

/// Runs `rank` on `ranks` ranks, each with its world communicator (on NCCL with
/// `config.nccl`) and a reporter that hands rank 0's step metrics to `on_step`. The ranks are
/// threads, or this process alone when the job runs one process per rank (`config.process`);
/// returns every rank's result (this process's only, then), or the error that caused the run
/// to fail (see [`first_cause`]).
pub(crate) fn launch_ranks<T: Send>(
    config: &TrainConfig,
    ranks: usize,
    on_step: &mut (dyn FnMut(&StepMetrics) + Send),
    rank: impl Fn(&Communicator, &mut dyn FnMut(&StepMetrics)) -> Result<T, TrainError> + Sync,
) -> Result<Vec<T>, TrainError> {
    if let Some(ctx) = &config.process {
        let world = world_of(ctx, config.nccl, process_gpu(ctx))?;
        let lead = ctx.rank() == 0;
        let mut forward = |m: &StepMetrics| {
            if lead {
                on_step(m);
            }
        };
        return Ok(vec![rank(&world, &mut forward)?]);
    }
    let on_step = std::sync::Mutex::new(on_step);
    let results = burn_comm::launch(ranks, |ctx| {
        let world = world_of(&ctx, config.nccl, 0)?;
        let mut forward = |m: &StepMetrics| {
            if ctx.rank() == 0 {
                (on_step.lock().unwrap_or_else(|e| e.into_inner()))(m);
            }
        };
        rank(&world, &mut forward)
    });
    first_cause(results)
}

/// The GPU a process of a job of processes drives: its rank on its machine, as torchrun's
/// convention has it (thread ranks share the default GPU, 0).
pub fn process_gpu(ctx: &burn_comm::RankContext) -> usize {
    ctx.local_rank()
}

/// The rank's world: the launched one, or the same ranks on NCCL over GPU `gpu` (the one the
/// trainer's CUDA device is).
fn world_of(
    ctx: &burn_comm::RankContext,
    nccl: bool,
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] gpu: usize,
) -> Result<Communicator, TrainError> {
    if !nccl {
        return Ok(ctx.world().clone());
    }
    #[cfg(feature = "cuda")]
    return Ok(ctx
        .world()
        .nccl(&burn::backend::cuda::CudaDevice { index: gpu })?);
    #[cfg(not(feature = "cuda"))]
    Err(TrainError::Config(
        "--nccl needs a build with --features cuda".into(),
    ))
}

/// Every rank's result, or the error that caused the run to fail: a rank's own failure rather
/// than its peers' "peer failed".
fn first_cause<T>(
    results: Vec<Result<T, burn_comm::RankError<TrainError>>>,
) -> Result<Vec<T>, TrainError> {
    let cause = results.iter().position(|r| match r {
        Err(burn_comm::RankError::Failed { error, .. }) => !error.is_peer_failure(),
        Err(burn_comm::RankError::Panicked { .. }) => true,
        Ok(_) => false,
    });
    let cause = cause.or_else(|| results.iter().position(Result::is_err));
    let mut results = results;
    match cause.map(|i| results.remove(i)) {
        // No rank failed.
        None => Ok(results.into_iter().filter_map(Result::ok).collect()),
        Some(Err(burn_comm::RankError::Failed { error, .. })) => Err(error),
        Some(Err(panicked)) => Err(TrainError::Config(panicked.to_string())),
        Some(Ok(_)) => unreachable!("the cause is an error"),
    }
}

#[cfg(test)]
mod tests {
    use burn_checkpoint::CheckpointError;
    use burn_comm::{CommError, RankError};

    use super::*;

    fn peer_failed() -> CommError {
        CommError::PeerFailed {
            rank: 1,
            group: "checkpoint".into(),
            op: "all_gather".into(),
            reason: "panicked".into(),
        }
    }

    #[test]
    fn the_cause_is_the_rank_that_failed_not_those_its_failure_reached() {
        let failed = |error| Err(RankError::Failed { rank: 0, error });
        let results: Vec<Result<(), RankError<TrainError>>> = vec![
            // What the others see when one rank's save fails, or a peer dies mid-save.
            failed(TrainError::PeerCheckpointFailed),
            failed(TrainError::Checkpoint(CheckpointError::Background {
                step: 2,
                source: Box::new(CheckpointError::Comm(peer_failed())),
            })),
            failed(TrainError::Checkpoint(CheckpointError::Comm(peer_failed()))),
            // The cause: a save that failed of itself, also inside a background save's error.
            failed(TrainError::Checkpoint(CheckpointError::Background {
                step: 2,
                source: Box::new(CheckpointError::Mismatch("rank 3's disk is full".into())),
            })),
        ];
        let cause = first_cause(results).unwrap_err().to_string();
        assert_eq!(cause, "the checkpoint after step 2: rank 3's disk is full");
    }
}
