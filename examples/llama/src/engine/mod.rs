//! How one rank runs a step, once per strategy. Each strategy is one [`Engine`] in its own file;
//! [`crate::run`] drives any of them with the one training loop, and [`choose`] picks the engine
//! for a configuration. A new strategy is a new file here and one line in [`choose`].

mod ddp;
mod fully_sharded;
mod parameter_server;
mod pipeline;
mod sharded;
mod single;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn_checkpoint::Checkpoint;
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::BackwardHooks;
use burn_pipeline::Span;
use burn_tensor_parallel::TpBackend;
use burn_zero::{ShardedDataParallel, StepOutcome, ZeroStage};

use crate::batches::Batches;
use crate::checkpoint::TrainingState;
use crate::dims::Groups;
use crate::model::Llama;
use crate::parallel_plan::ParallelPlan;
use crate::train::{StepMetrics, Strategy, TrainConfig, TrainError};
use crate::weights::Weights;

/// One rank's part of a strategy. The loop calls, each step, [`prepare`](Self::prepare), then
/// (on the step's clock) [`forward_backward`](Self::forward_backward) and
/// [`step`](Self::step), then reduces the loss over [`loss_groups`](Self::loss_groups); at the
/// end [`finish`](Self::finish).
pub(crate) trait Engine<B: AutodiffBackend> {
    /// Work of step `step` that is not timed: reading what the step needs, waiting for peers.
    fn prepare(
        &mut self,
        _step: usize,
        _batches: &Batches<'_>,
        _device: &B::Device,
    ) -> Result<(), TrainError> {
        Ok(())
    }

    /// Forward and backward of this rank's micro-batches of `step`; returns this rank's loss of
    /// the step (see [`loss_groups`](Self::loss_groups)).
    fn forward_backward(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError>;

    /// Steps the optimizer at `lr` with the step's gradients.
    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError>;

    /// The reductions, in order, that make this rank's loss the mean over the global batch.
    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)>;

    /// The trained model, whole, on every rank (a collective where it is split or sharded).
    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError>;

    /// This rank's pieces of the training state for a checkpoint (see `checkpoint.rs`), and
    /// the optimizer's step count.
    fn checkpoint_pieces(&self) -> Result<TrainingState, TrainError> {
        Err(not_checkpointed())
    }

    /// Restores the optimizer's state from `checkpoint` (the parameters were built from it).
    fn restore(&mut self, _checkpoint: &Checkpoint, _device: &B::Device) -> Result<(), TrainError> {
        Err(not_checkpointed())
    }
}

/// Why an engine without checkpoints refuses one (`ParallelDims::validate` refuses first).
fn not_checkpointed() -> TrainError {
    TrainError::Config(CHECKPOINTED_LAYOUTS.into())
}

/// The layouts that checkpoint, as a refusal says it.
const CHECKPOINTED_LAYOUTS: &str = "checkpoints are taken on one device, under DDP, ZeRO 1-3, pipelines (with any --tp and --sp) and the parameter server; drop --checkpoint-dir";

/// What an optimizer step reports.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stepped {
    /// Seconds this rank waited for gradient communication (see [`StepMetrics::comm_wait_s`]).
    pub comm_wait_s: f64,
    /// ZeRO's figures, if the step was ZeRO's.
    pub zero: Option<ZeroStep>,
    /// The global gradient norm before clipping.
    pub grad_norm: Option<f64>,
}

impl Stepped {
    /// Adds what the step did to `metrics`.
    pub fn fill(&self, metrics: &mut StepMetrics) {
        metrics.comm_wait_s = self.comm_wait_s;
        if let Some(zero) = &self.zero {
            metrics.model_state_bytes = Some(zero.bytes);
            metrics.loss_scale = zero.loss_scale;
            metrics.skipped = matches!(zero.outcome, StepOutcome::Skipped { .. });
        }
        metrics.grad_norm = self.grad_norm;
    }
}

/// What a ZeRO step adds to its metrics.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ZeroStep {
    /// Model-state bytes this rank held.
    pub bytes: usize,
    /// The loss scale the step ran with (f16).
    pub loss_scale: Option<f64>,
    /// Whether the optimizer stepped.
    pub outcome: StepOutcome,
}

impl ZeroStep {
    /// Steps `zero` and records what the step did.
    pub fn sharded<B: BackwardHooks, M: AutodiffModule<B>>(
        zero: &mut ShardedDataParallel<B, M>,
        lr: f64,
    ) -> Result<Self, TrainError> {
        let loss_scale = zero.loss_scale();
        let outcome = zero.step(lr)?;
        Ok(Self {
            bytes: zero.memory().total(),
            loss_scale,
            outcome,
        })
    }
}

/// What a rank ends with.
pub struct Finished<B: burn::tensor::backend::Backend> {
    /// The whole trained model.
    pub model: Llama<B>,
    /// The timeline of the pipeline's last step on this rank; empty for other engines.
    pub spans: Vec<Span>,
}

impl<B: burn::tensor::backend::Backend> Finished<B> {
    /// The whole of `trained`, this rank's part of the replica as `plan` cut it (a collective
    /// when it is split).
    pub fn gathered(plan: &ParallelPlan, trained: Llama<B>) -> Result<Self, TrainError> {
        Ok(Self {
            model: plan.gather(trained)?,
            spans: Vec::new(),
        })
    }
}

/// The backends a rank trains on: autodiff with DDP's backward hooks, and tensor parallelism's
/// operations on it and on its inner backend (where the trained model is gathered).
pub trait TrainBackend: BackwardHooks<InnerBackend: TpBackend> + TpBackend {}

impl<B: BackwardHooks<InnerBackend: TpBackend> + TpBackend> TrainBackend for B {}

/// The experts' weights of `parts` and the ranks holding the same ones, when the experts are
/// split (their gradients are averaged over those ranks only); none otherwise.
pub(crate) fn expert_group<'p, B: burn::tensor::backend::Backend>(
    groups: &Groups,
    parts: impl IntoIterator<Item = &'p Llama<B>>,
) -> Option<burn_ddp::ExpertGroup> {
    let comm = groups.expert_replicas.clone()?;
    let params = parts.into_iter().flat_map(Llama::expert_params).collect();
    Some(burn_ddp::ExpertGroup { comm, params })
}

/// The engine of `config` for this rank, over `groups`, starting from `model` (whole, the same
/// on every rank), cut as `plan` says.
pub(crate) fn choose<'a, B: TrainBackend>(
    config: &'a TrainConfig,
    plan: &'a ParallelPlan,
    weights: &Weights,
    groups: &Groups,
    batches: &Batches<'_>,
    device: &B::Device,
) -> Result<Box<dyn Engine<B> + 'a>, TrainError> {
    if config.pp > 1 {
        let engine = pipeline::PipelineEngine::new(config, plan, weights, groups, batches, device)?;
        return Ok(Box::new(engine));
    }
    // Gradients are averaged over every rank holding the same weights.
    let dp = || {
        groups
            .replicas
            .clone()
            .expect("a data-parallel strategy has its group")
    };
    if config.zero == ZeroStage::Parameters {
        let engine =
            fully_sharded::FullyShardedEngine::new(config, plan, weights, groups, dp(), device)?;
        return Ok(Box::new(engine));
    }
    let all = 0..config.model.num_hidden_layers;
    let replica = groups.set_up(
        weights
            .parts(&config.model, plan, &[all], &[0], groups.slices(), device)?
            .remove(0),
    );
    Ok(match (config.strategy, config.zero) {
        (Strategy::Single, _) => Box::new(single::SingleEngine::new(config, plan, replica)),
        (Strategy::Ddp, ZeroStage::Replicated) => {
            let experts = expert_group(groups, [&replica]);
            Box::new(ddp::DdpEngine::new(config, plan, replica, dp(), experts)?)
        }
        (Strategy::Ddp, _) => Box::new(sharded::ShardedEngine::new(
            config,
            plan,
            replica,
            dp(),
            groups.world.clone(),
        )?),
        (Strategy::ParameterServer, _) => Box::new(parameter_server::ParameterServerEngine::new(
            config,
            plan,
            replica,
            dp(),
        )?),
    })
}
