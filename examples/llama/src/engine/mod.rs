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
use burn::tensor::{Int, Tensor};
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::BackwardHooks;
use burn_pipeline::{PipelineStage, Span};
use burn_tensor_parallel::{TensorParallel, TpBackend};
use burn_zero::{ShardedDataParallel, StepOutcome, ZeroStage};

use crate::batches::Batches;
use crate::config::LlamaConfig;
use crate::dims::Groups;
use crate::model::Llama;
use crate::pipeline::{LlamaStage, MicroBatch};
use crate::tensor_parallel::TpLlama;
use crate::tp_stage::TpLlamaStage;
use crate::train::{StepMetrics, Strategy, TrainConfig, TrainError};

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
}

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

/// A model the loop can train as one replica: whole, or split over a tensor-parallel group.
pub trait Trainable<B: AutodiffBackend>: AutodiffModule<B> {
    /// Mean next-token cross-entropy of `targets` given `inputs`.
    fn loss(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 1>, TrainError>;

    /// The whole model from `trained`, this rank's weights (a collective when they are split).
    fn whole(trained: Self::InnerModule) -> Result<Llama<B::InnerBackend>, TrainError>;
}

impl<B: AutodiffBackend> Trainable<B> for Llama<B> {
    fn loss(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 1>, TrainError> {
        Ok(Llama::loss(self, inputs, targets))
    }

    fn whole(trained: Llama<B::InnerBackend>) -> Result<Llama<B::InnerBackend>, TrainError> {
        Ok(trained)
    }
}

impl<B: AutodiffBackend + TpBackend> Trainable<B> for TpLlama<B>
where
    B::InnerBackend: TpBackend,
{
    fn loss(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 1>, TrainError> {
        Ok(TpLlama::loss(self, inputs, targets)?)
    }

    fn whole(trained: TpLlama<B::InnerBackend>) -> Result<Llama<B::InnerBackend>, TrainError> {
        Ok(trained.full()?)
    }
}

/// A run of blocks the pipeline and ZeRO-3 train as a unit: whole, or split over a
/// tensor-parallel group.
pub trait TrainableStage<B: AutodiffBackend>:
    PipelineStage<B, Batch = MicroBatch<B>, Error = TrainError>
{
    /// The whole stage from `trained`, this rank's weights (a collective when they are split).
    fn whole(trained: Self::InnerModule) -> Result<LlamaStage<B::InnerBackend>, TrainError>;
}

impl<B: AutodiffBackend> TrainableStage<B> for LlamaStage<B> {
    fn whole(
        trained: LlamaStage<B::InnerBackend>,
    ) -> Result<LlamaStage<B::InnerBackend>, TrainError> {
        Ok(trained)
    }
}

impl<B: AutodiffBackend + TpBackend> TrainableStage<B> for TpLlamaStage<B>
where
    B::InnerBackend: TpBackend,
{
    fn whole(
        trained: TpLlamaStage<B::InnerBackend>,
    ) -> Result<LlamaStage<B::InnerBackend>, TrainError> {
        Ok(trained.full()?)
    }
}

/// How a rank holds its part of the weights: whole, or split over a tensor-parallel group.
pub(crate) trait Split<B: AutodiffBackend> {
    /// The replica type.
    type Replica: Trainable<B> + 'static;
    /// The stage type.
    type Stage: TrainableStage<B> + 'static;

    /// This rank's part of `model`, shaped `shape`.
    fn replica(&self, model: Llama<B>, shape: &LlamaConfig) -> Result<Self::Replica, TrainError>;
    /// This rank's part of `stage`.
    fn stage(&self, stage: LlamaStage<B>) -> Result<Self::Stage, TrainError>;
    /// The group whose collectives run inside the backward, if any (see
    /// `PipelineExecutor::with_backward_group`).
    fn backward_group(&self) -> Option<Communicator>;
}

/// Every rank holds its weights whole.
pub(crate) struct Whole;

impl<B: AutodiffBackend> Split<B> for Whole {
    type Replica = Llama<B>;
    type Stage = LlamaStage<B>;

    fn replica(&self, model: Llama<B>, _: &LlamaConfig) -> Result<Llama<B>, TrainError> {
        Ok(model)
    }

    fn stage(&self, stage: LlamaStage<B>) -> Result<LlamaStage<B>, TrainError> {
        Ok(stage)
    }

    fn backward_group(&self) -> Option<Communicator> {
        None
    }
}

impl<B: AutodiffBackend + TpBackend> Split<B> for TensorParallel
where
    B::InnerBackend: TpBackend,
{
    type Replica = TpLlama<B>;
    type Stage = TpLlamaStage<B>;

    fn replica(&self, model: Llama<B>, shape: &LlamaConfig) -> Result<TpLlama<B>, TrainError> {
        Ok(TpLlama::from_full(model, shape, self)?)
    }

    fn stage(&self, stage: LlamaStage<B>) -> Result<TpLlamaStage<B>, TrainError> {
        Ok(TpLlamaStage::from_stage(stage, self)?)
    }

    fn backward_group(&self) -> Option<Communicator> {
        Some(self.comm().clone())
    }
}

/// The engine of `config` for this rank, over `groups`, starting from `model` (whole, the same
/// on every rank), its weights held as `split` holds them.
pub(crate) fn choose<'a, B, S>(
    config: &'a TrainConfig,
    split: S,
    model: Llama<B>,
    groups: &Groups,
    batches: &Batches<'_>,
    device: &B::Device,
) -> Result<Box<dyn Engine<B> + 'a>, TrainError>
where
    B: BackwardHooks + TpBackend,
    B::InnerBackend: TpBackend,
    S: Split<B>,
{
    if config.pp > 1 {
        let engine = pipeline::PipelineEngine::new(config, &split, model, groups, batches, device)?;
        return Ok(Box::new(engine));
    }
    let dp = || {
        groups
            .dp
            .clone()
            .expect("a data-parallel strategy has its group")
    };
    Ok(match (config.strategy, config.zero) {
        (_, ZeroStage::Parameters) => Box::new(fully_sharded::FullyShardedEngine::new(
            config,
            &split,
            model,
            dp(),
        )?),
        (Strategy::Single, _) => Box::new(single::SingleEngine::new(
            config,
            split.replica(model, &config.model)?,
        )),
        (Strategy::Ddp, ZeroStage::Replicated) => Box::new(ddp::DdpEngine::new(
            config,
            split.replica(model, &config.model)?,
            dp(),
        )?),
        (Strategy::Ddp, _) => Box::new(sharded::ShardedEngine::new(
            config,
            split.replica(model, &config.model)?,
            dp(),
        )?),
        (Strategy::ParameterServer, _) => Box::new(parameter_server::ParameterServerEngine::new(
            config,
            split.replica(model, &config.model)?,
            dp(),
        )?),
    })
}
