//! A training run: its configuration and the rules of which layouts combine, its metrics and
//! errors, and [`train`], which starts its ranks. What each rank does is in [`crate::run`] and
//! [`crate::engine`]. Every layout reads the same global batches, starts from the same weights
//! and reports the same loss: the mean over the whole global batch.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorData, backend::Backend};
use burn_comm::{CommError, Communicator, ReduceOp};
use burn_ddp::{DdpConfig, DdpError, per_rank_batch};
use burn_pipeline::{PipelineError, ScheduleKind};
use burn_tensor_parallel::{ContextParallel, CpAttention, TensorParallel, TpError};
use burn_zero::{ZeroConfig, ZeroError, ZeroStage};
use serde::Serialize;

use crate::config::LlamaConfig;
use crate::data::Dataset;
use crate::dims::ParallelDims;
use crate::engine::TrainBackend;
use crate::experts::MoeMetrics;
use crate::launch::{check_processes, launch_ranks};
use crate::model::Llama;
use crate::run::{resave_rank, train_rank};
use crate::schedule::WarmupCosine;
use crate::weights::Weights;

/// How the data-parallel ranks share the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Strategy {
    /// One replica, plain burn: no data-parallel communicator at all (the replica is one
    /// device, or a tensor-parallel group with `tp > 1`).
    Single,
    /// DistributedDataParallel: bucketed, overlapped gradient all-reduce.
    Ddp,
    /// Parameter server: rank 0 gathers gradients, steps, broadcasts parameters.
    ParameterServer,
}

/// Everything a training run needs besides the data.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Model shape.
    pub model: LlamaConfig,
    /// Optimizer steps.
    pub steps: usize,
    /// Samples per step over all ranks.
    pub batch_size: usize,
    /// Samples per forward/backward on one rank; the rest is gradient accumulation.
    pub micro_batch_size: Option<usize>,
    /// Micro-batches per step on each rank (alternative to `micro_batch_size`).
    pub grad_accum: Option<usize>,
    /// Tokens per sample (inputs; targets are shifted by one).
    pub seq_len: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Warmup steps.
    pub warmup_steps: usize,
    /// Seed of the weights and of the data order.
    pub seed: u64,
    /// Data-parallel ranks (of each expert, under expert parallelism: see `ep`).
    pub dp: usize,
    /// Expert-parallel ranks: each holds its share of every mixture of experts' experts and
    /// reads its own samples, so `dp x ep` ranks share the batch.
    pub ep: usize,
    /// Tensor-parallel ranks per replica.
    pub tp: usize,
    /// Context-parallel ranks per replica: each holds `seq_len / cp` tokens of every sequence,
    /// cut load-balanced for the causal mask.
    pub cp: usize,
    /// How context-parallel attention reaches the other ranks' keys and values.
    pub cp_attention: CpAttention,
    /// Sequence parallelism within the tensor-parallel group.
    pub sequence_parallel: bool,
    /// Chunks of the collective matmuls that overlap the tensor-parallel communication with
    /// the linears' multiplications (Megatron's `tp_comm_overlap`); 0: one after the other.
    pub tp_overlap: usize,
    /// Pipeline ranks per replica.
    pub pp: usize,
    /// The pipeline schedule (with `pp > 1`); its micro-batches are the gradient-accumulation
    /// micro-batches.
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank (interleaved schedule).
    pub virtual_stages: usize,
    /// Activation recompute in the pipeline: keep only stage inputs, redo the forward before
    /// the backward.
    pub recompute: bool,
    /// How the blocks are shared out among the pipeline stages.
    pub balance: crate::pipeline::Balance,
    /// Draw the pipeline's last step (measured) as a Gantt chart here.
    pub schedule_svg: Option<std::path::PathBuf>,
    /// Data-parallel strategy.
    pub strategy: Strategy,
    /// DDP settings.
    pub ddp: DdpConfig,
    /// ZeRO stage of the data-parallel group (0: plain DDP). Stages 1-3 need the DDP
    /// strategy, whose gradient averaging they replace.
    pub zero: ZeroStage,
    /// ZeRO's settings (buckets, overlap, prefetch, offload, mixed precision); its
    /// `max_grad_norm` is replaced by this config's.
    pub zero_config: ZeroConfig,
    /// Clip the gradients to this global L2 norm before each step (Megatron's `--clip-grad`,
    /// DeepSpeed's `gradient_clipping`). None: no clipping.
    pub max_grad_norm: Option<f64>,
    /// Start from these weights (a directory written by `save`) instead of the seed.
    pub init_from: Option<std::path::PathBuf>,
    /// Checkpoint every so many steps, and resume from the newest checkpoint.
    pub checkpoint: Option<crate::checkpoint::CheckpointConfig>,
    /// Move the ranks' data with NCCL, in GPU memory (builds with the `cuda` feature, CUDA
    /// tensors only); else through host memory (the local transport).
    pub nccl: bool,
    /// This process's rank when the job runs one process per rank (started by `mpirun` or `burn-launch`, see
    /// `burn_comm::Process`); None: the ranks are threads of this process.
    pub process: Option<burn_comm::RankContext>,
    /// The memory this process's ranks may use (the host's available memory for a CPU run):
    /// a run whose estimate does not fit is refused before anything is built
    /// (`plan::check_memory`); none: not checked.
    pub memory_available: Option<u64>,
}

impl TrainConfig {
    /// Defaults for `model`: 8 samples of 64 tokens, lr 3e-3 with 10 warmup steps, one rank.
    pub fn new(model: LlamaConfig, steps: usize) -> Self {
        Self {
            model,
            steps,
            batch_size: 8,
            micro_batch_size: None,
            grad_accum: None,
            seq_len: 64,
            lr: 3e-3,
            warmup_steps: 10,
            seed: 42,
            dp: 1,
            ep: 1,
            tp: 1,
            cp: 1,
            cp_attention: CpAttention::Ring,
            sequence_parallel: false,
            tp_overlap: 0,
            pp: 1,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            recompute: false,
            balance: crate::pipeline::Balance::Params,
            schedule_svg: None,
            strategy: Strategy::Single,
            ddp: DdpConfig::new(),
            zero: ZeroStage::Replicated,
            zero_config: ZeroConfig::new(),
            max_grad_norm: None,
            init_from: None,
            checkpoint: None,
            nccl: false,
            process: None,
            memory_available: None,
        }
    }

    /// The tensor-parallel group over `group`, with this config's sequence parallelism and
    /// communication overlap.
    pub fn tensor_parallel(&self, group: &Communicator) -> TensorParallel {
        TensorParallel::new(group.clone())
            .with_sequence_parallel(self.sequence_parallel)
            .with_comm_overlap(self.tp_overlap)
    }

    /// The context-parallel group over `group`: load-balanced, with this config's attention.
    pub fn context_parallel(&self, group: Communicator) -> ContextParallel {
        ContextParallel::new(group, true).with_attention(self.cp_attention)
    }

    /// Samples per rank per step, micro-batch size and micro-batches per step, or a sentence
    /// saying what to change.
    pub fn layout(&self) -> Result<Layout, TrainError> {
        self.model.validate().map_err(TrainError::Config)?;
        if !(self.lr.is_finite() && self.lr > 0.0 && self.lr <= 1.0) {
            return Err(TrainError::Config(format!(
                "--lr {}: the learning rate must be positive and at most 1, past which AdamW only diverges (3e-3 suits `tiny` and `small`)",
                self.lr
            )));
        }
        let counts = [
            ("--steps", Some(self.steps)),
            ("--seq-len", Some(self.seq_len)),
            ("--batch-size", Some(self.batch_size)),
            ("--dp", Some(self.dp)),
            ("--ep", Some(self.ep)),
            ("--tp", Some(self.tp)),
            ("--cp", Some(self.cp)),
            ("--pp", Some(self.pp)),
            ("--virtual-stages", Some(self.virtual_stages)),
            ("--micro-batch-size", self.micro_batch_size),
            ("--grad-accum", self.grad_accum),
        ];
        if let Some((flag, _)) = counts.iter().find(|(_, count)| *count == Some(0)) {
            return Err(TrainError::Config(format!("{flag} must be at least 1")));
        }
        if let Some(max) = self.max_grad_norm
            && !(max.is_finite() && max > 0.0)
        {
            return Err(TrainError::Config(format!(
                "--clip-grad-norm {max}: clip to a positive finite norm (1.0 is usual)"
            )));
        }
        let dims = ParallelDims::of(self);
        dims.validate(self)?;
        let per_rank = per_rank_batch(self.batch_size, dims.data_ranks())?;
        let (micro, accum) = match (self.micro_batch_size, self.grad_accum) {
            (Some(_), Some(_)) => {
                return Err(TrainError::Config(
                    "give --micro-batch-size or --grad-accum, not both".into(),
                ));
            }
            (Some(micro), None) => (micro, per_rank.checked_div(micro).unwrap_or(0)),
            (None, Some(accum)) => (per_rank.checked_div(accum).unwrap_or(0), accum),
            (None, None) => (per_rank, 1),
        };
        if micro == 0 || accum == 0 || micro * accum != per_rank {
            return Err(TrainError::Config(format!(
                "each of the {} rank(s) gets {per_rank} samples per step, which is not {accum} micro-batch(es) of {micro}; pick a micro-batch size that divides {per_rank}",
                dims.data_ranks()
            )));
        }
        if self.strategy == Strategy::ParameterServer && accum != 1 {
            return Err(TrainError::Config(
                "the parameter-server baseline steps after every backward; use --grad-accum 1 with it".into(),
            ));
        }
        if self.pp > 1 {
            crate::pipeline::split(&self.model, self.pp, self.virtual_stages)?;
            burn_pipeline::Schedule::new(self.schedule, self.pp, accum, self.virtual_stages)
                .map_err(|e| {
                    TrainError::Config(format!(
                        "{e} (the pipeline's micro-batches are the {accum} of --grad-accum / --micro-batches)"
                    ))
                })?;
        }
        Ok(Layout {
            per_rank,
            micro,
            accum,
        })
    }

    /// The learning-rate schedule of the run.
    pub fn schedule(&self) -> WarmupCosine {
        WarmupCosine {
            peak: self.lr,
            warmup: self.warmup_steps.min(self.steps),
            total: self.steps,
            min_ratio: 0.1,
        }
    }

    /// The optimizer of every layout: AdamW as in Llama (betas 0.9/0.95, weight decay 0.1).
    pub fn optimizer(&self) -> AdamWConfig {
        AdamWConfig::new()
            .with_beta_2(0.95)
            .with_epsilon(1e-8)
            .with_weight_decay(0.1)
    }

    /// ZeRO's settings with this run's gradient clipping.
    pub(crate) fn zero_engine_config(&self) -> ZeroConfig {
        self.zero_config
            .clone()
            .with_max_grad_norm(self.max_grad_norm)
    }

    /// `grads` of a replicated `model` clipped to [`max_grad_norm`](Self::max_grad_norm), with
    /// their norm before; as they are without clipping.
    pub(crate) fn clip<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        grads: GradientsParams,
    ) -> (GradientsParams, Option<f64>) {
        match self.max_grad_norm {
            Some(max) => {
                let (grads, norm) = burn_ddp::clip_grad_norm(model, grads, max);
                (grads, Some(norm))
            }
            None => (grads, None),
        }
    }
}

/// How a step's global batch is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Samples per rank per step.
    pub per_rank: usize,
    /// Samples per forward/backward.
    pub micro: usize,
    /// Micro-batches per step.
    pub accum: usize,
}

/// What a run can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A configuration that cannot work.
    #[error("{0}")]
    Config(String),
    /// Data parallelism failed.
    #[error(transparent)]
    Ddp(#[from] DdpError),
    /// Communication failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Tensor parallelism failed.
    #[error(transparent)]
    Tp(#[from] TpError),
    /// Pipeline parallelism failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// ZeRO failed.
    #[error(transparent)]
    Zero(#[from] ZeroError),
    /// A checkpoint could not be saved.
    #[error(transparent)]
    Checkpoint(#[from] burn_checkpoint::CheckpointError),
    /// Another rank's checkpoint could not be saved (that rank says why).
    #[error("another rank's checkpoint failed while this one's was saved")]
    PeerCheckpointFailed,
    /// SIGTERM or SIGINT stopped the run after `step`, whose checkpoint is in `dir`.
    #[error(
        "stopped by a signal after step {step}, checkpointed in {}; run the same command with --resume to continue",
        dir.display()
    )]
    Interrupted {
        step: usize,
        dir: std::path::PathBuf,
    },
}

impl TrainError {
    /// Whether this rank failed only because a peer did (so the peer's error is the cause).
    pub(crate) fn is_peer_failure(&self) -> bool {
        use burn_checkpoint::CheckpointError as Checkpoint;
        let in_checkpoint = |error: &Checkpoint| match error {
            Checkpoint::Background { source, .. } => {
                matches!(**source, Checkpoint::Comm(CommError::PeerFailed { .. }))
            }
            error => matches!(error, Checkpoint::Comm(CommError::PeerFailed { .. })),
        };
        if let TrainError::Checkpoint(error) = self {
            return in_checkpoint(error);
        }
        matches!(
            self,
            TrainError::PeerCheckpointFailed
                | TrainError::Comm(CommError::PeerFailed { .. })
                | TrainError::Ddp(DdpError::Comm(CommError::PeerFailed { .. }))
                | TrainError::Tp(TpError::Comm(CommError::PeerFailed { .. }))
                | TrainError::Pipeline(PipelineError::Comm(CommError::PeerFailed { .. }))
                | TrainError::Zero(ZeroError::Comm(CommError::PeerFailed { .. }))
        )
    }
}

/// One optimizer step, as written to `--metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepMetrics {
    /// Step number, from 1.
    pub step: usize,
    /// Mean cross-entropy over the whole global batch (nats per token); for a mixture of
    /// experts, without its routers' losses (see `moe`).
    pub loss: f64,
    /// Learning rate used for this step.
    pub lr: f64,
    /// Tokens processed in this step, over all ranks.
    pub tokens: usize,
    /// Tokens per second over all ranks, for this step.
    pub tokens_per_s: f64,
    /// Wall time of this step.
    pub seconds: f64,
    /// Wall time since the first step started.
    pub elapsed: f64,
    /// Time this rank waited for gradient communication after backward: 0 on one device,
    /// NaN (null in JSON) for the parameter server, whose communication is the step itself.
    pub comm_wait_s: f64,
    /// Bytes of model state (parameters, gradients, optimizer state) rank 0 held in this step,
    /// under ZeRO; absent otherwise.
    pub model_state_bytes: Option<usize>,
    /// The loss scale of this step (f16 mixed precision); absent otherwise.
    pub loss_scale: Option<f64>,
    /// The gradients overflowed (inf or NaN) at `loss_scale`: the weights did not change and
    /// the scale was lowered.
    pub skipped: bool,
    /// The global L2 norm of the gradient before clipping, under `--clip-grad-norm`.
    pub grad_norm: Option<f64>,
    /// How long the run stalled after this step to hand its state to a checkpoint (written in
    /// the background); absent after steps that do not checkpoint.
    pub checkpoint_s: Option<f64>,
    /// A mixture of experts' figures (its routers' losses, which `loss` leaves out, and how
    /// evenly the experts were used); absent for a dense model.
    pub moe: Option<MoeMetrics>,
}

impl StepMetrics {
    /// The metrics of step `step` (from 0), which began at `begun`, of a run that started at
    /// `started`.
    pub(crate) fn measure(
        step: usize,
        loss: f64,
        lr: f64,
        tokens: usize,
        (begun, started): (Instant, Instant),
    ) -> Self {
        let seconds = begun.elapsed().as_secs_f64();
        Self {
            step: step + 1,
            loss,
            lr,
            tokens,
            tokens_per_s: tokens as f64 / seconds,
            seconds,
            elapsed: started.elapsed().as_secs_f64(),
            comm_wait_s: 0.0,
            model_state_bytes: None,
            loss_scale: None,
            skipped: false,
            grad_norm: None,
            checkpoint_s: None,
            moe: None,
        }
    }
}

/// A one-element tensor's value.
pub(crate) fn scalar<B: Backend>(loss: &Tensor<B, 1>) -> f64 {
    loss.clone().into_scalar().elem::<f64>()
}

/// Every rank's `value` reduced with `op` over `comm`.
pub(crate) fn reduce_scalar<B: Backend>(
    comm: &Communicator,
    value: f64,
    op: ReduceOp,
    device: &B::Device,
) -> Result<f64, CommError> {
    let local = Tensor::<B, 1>::from_data(TensorData::new(vec![value], [1]), device);
    Ok(scalar(&comm.all_reduce(local, op)?))
}

/// Runs `config` on its `dp x ep x pp x cp x tp` ranks and returns the final weights, whole; `on_step`
/// sees rank 0's metrics. The ranks are threads, or this process's rank alone under
/// `config.process`; one rank of the single-device strategy runs here, without a communicator.
pub fn train<B: TrainBackend>(
    config: &TrainConfig,
    data: &dyn Dataset,
    device: &B::Device,
    on_step: &mut (dyn FnMut(&StepMetrics) + Send),
) -> Result<Llama<B::InnerBackend>, TrainError> {
    let layout = config.layout()?;
    check_processes(config)?;
    if let Some(available) = config.memory_available {
        crate::plan::check_memory(config, &layout, available)?;
    }
    let weights = Weights::of(config)?;
    if let Some(checkpoint) = weights.resumed() {
        crate::checkpoint::check_steps_left(config, checkpoint)?;
    }
    let dims = ParallelDims::of(config);
    if dims.ranks() == 1 && config.strategy == Strategy::Single {
        return Ok(train_rank::<B>(config, data, None, &weights, device, on_step)?.model);
    }
    let results = launch_ranks(config, dims.ranks(), on_step, |world, forward| {
        let finished = train_rank::<B>(config, data, Some(world), &weights, device, forward)?;
        let timeline = match config.schedule_svg {
            Some(_) => measured_timeline(config, &dims, world, &finished.spans)?,
            None => None,
        };
        // Threads keep rank 0's model only; a process keeps its own.
        let keep = world.rank() == 0 || config.process.is_some();
        Ok((keep.then_some(finished.model), timeline))
    })?;
    let (model, timeline) = results.into_iter().next().expect("one result per rank");
    if let (Some(path), Some(timeline)) = (&config.schedule_svg, timeline) {
        let title = format!(
            "{} measured, pp {}, {} micro-batches, {} chunk(s) per rank{}",
            config.schedule,
            config.pp,
            config.layout()?.accum,
            config.virtual_stages,
            if config.recompute { ", recompute" } else { "" }
        );
        std::fs::write(path, timeline.to_svg(&title))
            .map_err(|e| TrainError::Config(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(model.expect("the first result is rank 0's, or this process's"))
}

/// The last step's timeline of the pipeline's first copy (the stages' ranks of the first
/// replica, and the first of their context- and tensor-parallel peers), in stage order, on
/// rank 0; `None` on the other ranks. Every rank calls it: the ranks may be processes, which
/// hold their own spans only.
fn measured_timeline(
    config: &TrainConfig,
    dims: &ParallelDims,
    world: &Communicator,
    spans: &[burn_pipeline::Span],
) -> Result<Option<burn_pipeline::Timeline>, TrainError> {
    // The spans travel in host memory, so the group is split from the ranks' host group: one
    // split from a world on NCCL has none.
    let world = world.host().ok_or_else(|| {
        TrainError::Config("--schedule-svg needs the ranks' host group beside NCCL".into())
    })?;
    let first = dims.is_first_copy(world.rank());
    // The first copy's ranks, in world order: stage order, rank 0 first.
    let group = world.split("timeline", usize::from(!first))?;
    match first {
        true => Ok(burn_pipeline::Timeline::gather(
            &group,
            spans,
            config.virtual_stages,
        )?),
        false => Ok(None),
    }
}

/// Reads the newest checkpoint of the run `config` resumes into `config`'s layout, every rank
/// taking the blocks it would train with, and saves that state again, unchanged, as the
/// checkpoint of the same step under `to`: the checkpoint resharded offline, as Megatron's
/// tests save in one layout, load in another and save again. Returns its step.
pub fn resave<B: TrainBackend>(
    config: &TrainConfig,
    data: &dyn Dataset,
    device: &B::Device,
    to: &std::path::Path,
) -> Result<usize, TrainError> {
    config.layout()?;
    check_processes(config)?;
    // Its `latest` would be moved back to this step, or another run's mixed in.
    if let Some(there) =
        burn_checkpoint::Checkpoint::latest(to).map_err(|e| TrainError::Config(e.to_string()))?
    {
        return Err(TrainError::Config(format!(
            "{} already holds checkpoints (the newest after step {}); save into an empty directory",
            to.display(),
            there.step()
        )));
    }
    let weights = Weights::of(config)?;
    let dims = ParallelDims::of(config);
    if dims.ranks() == 1 && config.strategy == Strategy::Single {
        return resave_rank::<B>(config, data, None, &weights, device, to);
    }
    let steps = launch_ranks(config, dims.ranks(), &mut |_| {}, |world, _| {
        resave_rank::<B>(config, data, Some(world), &weights, device, to)
    })?;
    Ok(steps[0])
}
