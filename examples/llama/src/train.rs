//! The training loop, one function per rank, for every data-parallel strategy:
//! a plain single-device burn loop (the oracle and the baseline), DistributedDataParallel and
//! the parameter-server DataParallel, each over a replica that is either the whole model on
//! one rank or the model split over a tensor-parallel group (`tp` ranks, on a `dp x tp`
//! mesh). Every layout reads the same global batches, starts from the same weights and
//! reports the same loss: the mean over the whole global batch.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData, backend::Backend};
use burn_comm::{CommError, Communicator, DeviceMesh, ReduceOp};
use burn_ddp::{
    BackwardHooks, DataParallel, DdpConfig, DdpError, DistributedDataParallel, DistributedSampler,
    per_rank_batch,
};
use burn_pipeline::{PipelineError, ScheduleKind};
use burn_tensor_parallel::TpBackend;
use burn_tensor_parallel::{TensorParallel, TpError};
use burn_zero::{ZeroConfig, ZeroError, ZeroStage};
use serde::Serialize;

use crate::config::LlamaConfig;
use crate::data::Dataset;
use crate::model::Llama;
use crate::pipeline::LlamaStage;
use crate::schedule::WarmupCosine;
use crate::tensor_parallel::{TpLlama, check_split};
use crate::zero::Extras;

/// Why a model with a tied head is refused where it would be split.
pub const TIED_NOT_SPLIT: &str = "the model ties its head to its embedding (tie_word_embeddings), which is not yet split over --pp or ZeRO-3's units; train it with --dp, --tp and --zero 0, 1 or 2";

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
    /// Data-parallel ranks.
    pub dp: usize,
    /// Tensor-parallel ranks per replica.
    pub tp: usize,
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
    /// Move the ranks' data with NCCL, in GPU memory (builds with the `cuda` feature, CUDA
    /// tensors only); else through host memory (the local transport).
    pub nccl: bool,
    /// This process's rank when the job runs one process per rank (started by `mpirun`, see
    /// `burn_comm::Process`); None: the ranks are threads of this process.
    pub process: Option<burn_comm::RankContext>,
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
            tp: 1,
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
            nccl: false,
            process: None,
        }
    }

    /// The tensor-parallel group over `group`, with this config's sequence parallelism and
    /// communication overlap.
    pub fn tensor_parallel(&self, group: &Communicator) -> TensorParallel {
        TensorParallel::new(group.clone())
            .with_sequence_parallel(self.sequence_parallel)
            .with_comm_overlap(self.tp_overlap)
    }

    /// Samples per rank per step, micro-batch size and micro-batches per step, or a sentence
    /// saying what to change.
    pub fn layout(&self) -> Result<Layout, TrainError> {
        self.model.validate().map_err(TrainError::Config)?;
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(TrainError::Config(format!(
                "--lr {}: the learning rate must be positive and finite (3e-3 suits `tiny` and `small`)",
                self.lr
            )));
        }
        let counts = [
            ("--steps", Some(self.steps)),
            ("--seq-len", Some(self.seq_len)),
            ("--batch-size", Some(self.batch_size)),
            ("--dp", Some(self.dp)),
            ("--tp", Some(self.tp)),
            ("--pp", Some(self.pp)),
            ("--virtual-stages", Some(self.virtual_stages)),
            ("--micro-batch-size", self.micro_batch_size),
            ("--grad-accum", self.grad_accum),
        ];
        if let Some((flag, _)) = counts.iter().find(|(_, count)| *count == Some(0)) {
            return Err(TrainError::Config(format!("{flag} must be at least 1")));
        }
        if self.strategy == Strategy::Single && self.dp != 1 {
            return Err(TrainError::Config(format!(
                "the single-device strategy runs one rank, not --dp {}; choose --strategy ddp or parameter-server",
                self.dp
            )));
        }
        if self.pp > 1 && self.strategy == Strategy::ParameterServer {
            return Err(TrainError::Config(
                "the parameter-server baseline replicates whole models; use --strategy ddp with --pp".into(),
            ));
        }
        let pipeline_only = self.virtual_stages != 1
            || self.recompute
            || self.balance != crate::pipeline::Balance::Params;
        if self.pp == 1 && pipeline_only {
            return Err(TrainError::Config(
                "--virtual-stages, --recompute and --balance belong to pipeline parallelism; use them with --pp 2 or more".into(),
            ));
        }
        if self.sequence_parallel && self.tp == 1 {
            return Err(TrainError::Config(
                "--sp splits sequences over the tensor-parallel ranks; use it with --tp 2 or more"
                    .into(),
            ));
        }
        if self.tp_overlap > 0 && self.tp == 1 {
            return Err(TrainError::Config(
                "--tp-overlap overlaps the tensor-parallel ranks' communication; use it with --tp 2 or more"
                    .into(),
            ));
        }
        check_split(&self.model, self.tp, self.sequence_parallel, self.seq_len)
            .map_err(TrainError::Config)?;
        if self.model.tie_word_embeddings && (self.pp > 1 || self.zero == ZeroStage::Parameters) {
            return Err(TrainError::Config(TIED_NOT_SPLIT.into()));
        }
        if self.strategy == Strategy::ParameterServer && self.tp > 1 {
            return Err(TrainError::Config(
                "the parameter-server baseline replicates whole models; use --strategy ddp with --tp".into(),
            ));
        }
        if self.zero != ZeroStage::Replicated {
            if self.strategy != Strategy::Ddp {
                return Err(TrainError::Config(format!(
                    "--zero {} shards the data-parallel group's model state; use it with --strategy ddp (the default for --dp 2 or more)",
                    self.zero.number()
                )));
            }
            if self.pp > 1 && self.zero != ZeroStage::OptimizerState {
                return Err(TrainError::Config(format!(
                    "--zero {} with --pp: the pipeline holds each stage's whole gradient until its last micro-batch, so only ZeRO-1 helps there (as in DeepSpeed); use --zero 1",
                    self.zero.number()
                )));
            }
        } else if self.zero_config.precision.is_some() {
            return Err(TrainError::Config(
                "--dtype bf16 and f16 keep fp32 master weights in ZeRO's sharded optimizer; add --zero 1, 2 or 3 (also at --dp 1)".into(),
            ));
        }
        if let Some(max) = self.max_grad_norm {
            if !(max.is_finite() && max > 0.0) {
                return Err(TrainError::Config(format!(
                    "--clip-grad-norm {max}: clip to a positive finite norm (1.0 is usual)"
                )));
            }
            if self.tp > 1 || self.pp > 1 || self.strategy == Strategy::ParameterServer {
                return Err(TrainError::Config(
                    "--clip-grad-norm needs the whole gradient's norm on every rank, which this run only has with one device, DDP or ZeRO; drop --tp, --pp or the parameter server to clip".into(),
                ));
            }
        }
        let per_rank = per_rank_batch(self.batch_size, self.dp)?;
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
                self.dp
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
    fn clip<B: AutodiffBackend, M: AutodiffModule<B>>(
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
}

impl TrainError {
    /// Whether this rank failed only because a peer did (so the peer's error is the cause).
    fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            TrainError::Comm(CommError::PeerFailed { .. })
                | TrainError::Ddp(DdpError::Comm(CommError::PeerFailed { .. }))
                | TrainError::Tp(TpError::Comm(CommError::PeerFailed { .. }))
                | TrainError::Pipeline(PipelineError::Comm(CommError::PeerFailed { .. }))
                | TrainError::Zero(ZeroError::Comm(CommError::PeerFailed { .. }))
        )
    }
}

/// A model the loop can train: one replica, whole or split over a tensor-parallel group.
pub trait Trainable<B: AutodiffBackend>: AutodiffModule<B> {
    /// Mean next-token cross-entropy of `targets` given `inputs`.
    fn loss(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 1>, TrainError>;
}

impl<B: AutodiffBackend> Trainable<B> for Llama<B> {
    fn loss(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 1>, TrainError> {
        Ok(Llama::loss(self, inputs, targets))
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
}

/// One optimizer step, as written to `--metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepMetrics {
    /// Step number, from 1.
    pub step: usize,
    /// Mean cross-entropy over the whole global batch (nats per token).
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
        comm_wait_s: f64,
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
            comm_wait_s,
            model_state_bytes: None,
            loss_scale: None,
            skipped: false,
            grad_norm: None,
        }
    }
}

/// Trains one rank's replica. `comm` is the data-parallel group (`None` for
/// [`Strategy::Single`]); `on_step` sees every step's metrics (the same on every rank).
/// Returns the final weights.
pub fn train_rank<B: BackwardHooks, M: Trainable<B>>(
    config: &TrainConfig,
    data: &dyn Dataset,
    comm: Option<&Communicator>,
    init: M,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<M, TrainError> {
    let layout = config.layout()?;
    if config.strategy != Strategy::Single && comm.is_none() {
        return Err(TrainError::Config(format!(
            "the {:?} strategy needs the data-parallel group; run it through `train`",
            config.strategy
        )));
    }
    let (world, rank) = comm.map_or((1, 0), |c| (c.size(), c.rank()));
    if world != config.dp {
        return Err(TrainError::Config(format!(
            "the group has {world} rank(s) but --dp is {}",
            config.dp
        )));
    }
    let batches = Batches::new(config, data, world, rank, layout)?;
    let mut optimizer = config.optimizer().init::<B, M>();
    let schedule = config.schedule();
    let tokens = config.batch_size * config.seq_len;
    let started = Instant::now();
    let mut report = |step: usize, loss: f64, begun: Instant, wait: f64, extras: Extras| {
        let mut metrics = StepMetrics::measure(
            step,
            loss,
            schedule.lr(step),
            tokens,
            (begun, started),
            wait,
        );
        extras.fill(&mut metrics);
        on_step(&metrics);
    };

    match config.strategy {
        Strategy::Single => {
            let mut model = init;
            for step in 0..config.steps {
                let begun = Instant::now();
                let mut accumulator = GradientsAccumulator::new();
                let mut loss_sum = 0.0;
                for micro in 0..layout.accum {
                    let (inputs, targets) = batches.micro(step, micro, device);
                    let loss = model.loss(inputs, targets)? / layout.accum as f64;
                    loss_sum += scalar(&loss);
                    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
                    accumulator.accumulate(&model, grads);
                }
                let (grads, grad_norm) = config.clip(&model, accumulator.grads());
                model = optimizer.step(schedule.lr(step), model, grads);
                let extras = Extras {
                    grad_norm,
                    ..Extras::default()
                };
                report(step, loss_sum, begun, 0.0, extras);
            }
            Ok(model)
        }
        Strategy::Ddp if config.zero != ZeroStage::Replicated => {
            let comm = comm.expect("a ZeRO run has a group");
            crate::zero::train_sharded(config, &batches, comm, init, device, &mut report)
        }
        Strategy::Ddp => {
            let comm = comm.expect("a DDP run has a group");
            let mut ddp = DistributedDataParallel::new(init, comm.clone(), config.ddp.clone())?;
            for step in 0..config.steps {
                let begun = Instant::now();
                let mut loss_sum = 0.0;
                let mut grads = None;
                for micro in 0..layout.accum {
                    let (inputs, targets) = batches.micro(step, micro, device);
                    let loss = ddp.module().loss(inputs, targets)? / layout.accum as f64;
                    loss_sum += scalar(&loss);
                    if micro + 1 < layout.accum {
                        ddp.backward_no_sync(loss);
                    } else {
                        grads = Some(ddp.backward(loss)?);
                    }
                }
                let grads = grads.expect("the last micro-batch synchronises");
                let (grads, grad_norm) = config.clip(ddp.module(), grads);
                ddp.step(&mut optimizer, schedule.lr(step), grads);
                let loss = reduce_scalar::<B::InnerBackend>(comm, loss_sum, ReduceOp::Avg, device)?;
                let extras = Extras {
                    grad_norm,
                    ..Extras::default()
                };
                report(
                    step,
                    loss,
                    begun,
                    ddp.stats().comm_wait.as_secs_f64(),
                    extras,
                );
            }
            Ok(ddp.into_module())
        }
        Strategy::ParameterServer => {
            let comm = comm.expect("a parameter-server run has a group");
            let mut dp = DataParallel::new(init, comm.clone())?;
            for step in 0..config.steps {
                let begun = Instant::now();
                let global = (rank == 0).then(|| batches.global(step, device));
                let local = dp.scatter(global, device)?;
                let len = config.seq_len;
                let inputs = local.clone().narrow(1, 0, len);
                let targets = local.narrow(1, 1, len);
                let loss = dp.module().loss(inputs, targets)?;
                let loss_value = scalar(&loss);
                dp.step(loss, &mut optimizer, schedule.lr(step))?;
                let loss =
                    reduce_scalar::<B::InnerBackend>(comm, loss_value, ReduceOp::Avg, device)?;
                // Its communication is inside `step`, not separable from it.
                report(step, loss, begun, f64::NAN, Extras::default());
            }
            Ok(dp.into_module())
        }
    }
}

fn scalar<B: Backend>(loss: &Tensor<B, 1>) -> f64 {
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

/// The samples of every step for one rank, from the sampler.
pub(crate) struct Batches<'a> {
    data: &'a dyn Dataset,
    /// This rank's share of every global batch.
    rank: Reading,
    /// Whole global batches, in the single-device order (for the parameter server's rank 0).
    single: Reading,
    micro: usize,
    seq_len: usize,
}

/// A sampler read `per_step` samples at a time, with its current epoch's order kept: a
/// permutation of the whole dataset is too costly to rebuild for every micro-batch.
struct Reading {
    sampler: DistributedSampler,
    per_step: usize,
    epoch: RefCell<Option<(usize, Rc<Vec<usize>>)>>,
}

impl Reading {
    fn new(sampler: DistributedSampler, per_step: usize) -> Self {
        Self {
            sampler,
            per_step,
            epoch: RefCell::new(None),
        }
    }

    /// The reading order of `step`'s epoch, and where `step` starts in it.
    fn step(&self, step: usize) -> (Rc<Vec<usize>>, usize) {
        let steps_per_epoch = self.sampler.num_samples() / self.per_step;
        let (epoch, position) = (step / steps_per_epoch, step % steps_per_epoch);
        let cached = self.epoch.borrow().clone().filter(|(e, _)| *e == epoch);
        let order = match cached {
            Some((_, order)) => order,
            None => {
                let order = Rc::new(self.sampler.indices(epoch as u64));
                *self.epoch.borrow_mut() = Some((epoch, order.clone()));
                order
            }
        };
        (order, position * self.per_step)
    }
}

impl<'a> Batches<'a> {
    pub(crate) fn new(
        config: &TrainConfig,
        data: &'a dyn Dataset,
        world: usize,
        rank: usize,
        layout: Layout,
    ) -> Result<Self, TrainError> {
        // Without padding, every layout cuts the epoch's permutation into the same global batches.
        let sampler = |world, rank| -> Result<DistributedSampler, DdpError> {
            Ok(DistributedSampler::new(data.len(), world, rank)?
                .with_seed(config.seed)
                .with_drop_last(true))
        };
        let (rank, single) = (sampler(world, rank)?, sampler(1, 0)?);
        if data.len() < config.batch_size {
            return Err(TrainError::Config(format!(
                "the dataset has {} samples, fewer than one global batch of {}; use more data or a smaller --batch-size",
                data.len(),
                config.batch_size
            )));
        }
        Ok(Self {
            data,
            rank: Reading::new(rank, layout.per_rank),
            single: Reading::new(single, config.batch_size),
            micro: layout.micro,
            seq_len: config.seq_len,
        })
    }

    /// Samples `[start, start + count)` of `reading`'s samples for `step`, as tokens.
    fn read<B: Backend>(
        &self,
        reading: &Reading,
        step: usize,
        start: usize,
        count: usize,
        device: &B::Device,
    ) -> Tensor<B, 2, Int> {
        let (order, first) = reading.step(step);
        let first = first + start;
        let tokens: Vec<i64> = order[first..first + count]
            .iter()
            .flat_map(|&i| self.data.sample(i))
            .map(|t| t as i64)
            .collect();
        Tensor::from_data(TensorData::new(tokens, [count, self.seq_len + 1]), device)
    }

    /// Inputs and targets of this rank's micro-batch `micro` of `step`.
    pub(crate) fn micro<B: Backend>(
        &self,
        step: usize,
        micro: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let m = self.micro;
        let tokens = self.read(&self.rank, step, micro * m, m, device);
        (
            tokens.clone().narrow(1, 0, self.seq_len),
            tokens.narrow(1, 1, self.seq_len),
        )
    }

    /// The whole global batch of `step`, in the single-device order (for the parameter server).
    fn global<B: Backend>(&self, step: usize, device: &B::Device) -> Tensor<B, 2, Int> {
        self.read(&self.single, step, 0, self.single.per_step, device)
    }
}

/// Runs `config` on `config.dp * config.tp` ranks (threads) and returns the final weights,
/// whole; `on_step` sees rank 0's metrics.
pub fn train<B: BackwardHooks + TpBackend>(
    config: &TrainConfig,
    data: &dyn Dataset,
    device: &B::Device,
    on_step: &mut (dyn FnMut(&StepMetrics) + Send),
) -> Result<Llama<B::InnerBackend>, TrainError>
where
    B::InnerBackend: TpBackend,
{
    config.layout()?;
    check_processes(config)?;
    let init = || -> Result<Llama<B>, TrainError> {
        match &config.init_from {
            None => Ok(Llama::init(&config.model, config.seed, device)),
            Some(dir) => {
                let (shape, model) =
                    crate::hf::load::<B>(dir, device).map_err(TrainError::Config)?;
                if shape != config.model {
                    return Err(TrainError::Config(format!(
                        "{} holds a model of another shape than the one asked for; drop --model or pick the matching preset",
                        dir.display()
                    )));
                }
                Ok(model)
            }
        }
    };
    if config.pp > 1 {
        return train_pipeline::<B>(config, data, device, &init, on_step);
    }
    if config.zero == ZeroStage::Parameters {
        return crate::zero::train_fully_sharded::<B>(config, data, device, &init, on_step);
    }
    if config.strategy == Strategy::Single && config.tp == 1 {
        return Ok(train_rank(config, data, None, init()?, device, on_step)?.valid());
    }
    let ranks = config.dp * config.tp;
    let mut results = launch_ranks(config, ranks, on_step, |world, forward| {
        let model = init()?;
        let data_parallel =
            |group: &Communicator| (config.strategy != Strategy::Single).then_some(group.clone());
        if config.tp == 1 {
            let dp = data_parallel(world);
            return train_rank(config, data, dp.as_ref(), model, device, forward)
                .map(|model| model.valid());
        }
        // Tensor-parallel peers are neighbours on the mesh (tp varies fastest).
        let mesh = DeviceMesh::new(world, &[("dp", config.dp), ("tp", config.tp)])?;
        let dp = data_parallel(mesh.group("dp")?);
        let tp = config.tensor_parallel(mesh.group("tp")?);
        let model = TpLlama::from_full(model, &config.model, &tp)?;
        let model = train_rank(config, data, dp.as_ref(), model, device, forward)?;
        Ok(model.valid().full()?)
    })?;
    Ok(results.remove(0))
}

/// Refuses a job whose processes do not match the layout's ranks, and the outputs that one
/// process cannot make.
fn check_processes(config: &TrainConfig) -> Result<(), TrainError> {
    let Some(ctx) = &config.process else {
        return Ok(());
    };
    let ranks = config.dp * config.pp * config.tp;
    if ctx.world_size() != ranks {
        return Err(TrainError::Config(format!(
            "this layout (dp {} x pp {} x tp {}) needs {ranks} ranks but the job has {} processes; start it with `mpirun -n {ranks}`, or without mpirun to run the ranks as threads",
            config.dp,
            config.pp,
            config.tp,
            ctx.world_size()
        )));
    }
    if config.schedule_svg.is_some() {
        return Err(TrainError::Config(
            "--schedule-svg draws every pipeline rank's timeline, which one process does not hold: run the pipeline without mpirun, as threads, to draw it".into(),
        ));
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
        let world = world_of(ctx, config.nccl)?;
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
        let world = world_of(&ctx, config.nccl)?;
        let mut forward = |m: &StepMetrics| {
            if ctx.rank() == 0 {
                (on_step.lock().unwrap_or_else(|e| e.into_inner()))(m);
            }
        };
        rank(&world, &mut forward)
    });
    first_cause(results)
}

/// The rank's world: the launched one, or the same ranks on NCCL over the default GPU (the one
/// the trainer's CUDA device is).
fn world_of(ctx: &burn_comm::RankContext, nccl: bool) -> Result<Communicator, TrainError> {
    if !nccl {
        return Ok(ctx.world().clone());
    }
    #[cfg(feature = "cuda")]
    return Ok(ctx.world().nccl(&Default::default())?);
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

/// Runs `config` on a `dp x pp x tp` mesh (tp fastest) and returns the whole model, joined
/// from the stages of the first replica.
fn train_pipeline<B: BackwardHooks + TpBackend>(
    config: &TrainConfig,
    data: &dyn Dataset,
    device: &B::Device,
    init: &(dyn Fn() -> Result<Llama<B>, TrainError> + Sync),
    on_step: &mut (dyn FnMut(&StepMetrics) + Send),
) -> Result<Llama<B::InnerBackend>, TrainError>
where
    B::InnerBackend: TpBackend,
{
    let ranks = config.dp * config.pp * config.tp;
    let results = launch_ranks(config, ranks, on_step, |world, forward| {
        // Tensor-parallel peers are neighbours on the mesh, then the stages of a pipeline.
        let mesh = DeviceMesh::new(
            world,
            &[("dp", config.dp), ("pp", config.pp), ("tp", config.tp)],
        )?;
        let dp = (config.strategy != Strategy::Single).then(|| mesh.group("dp").cloned());
        let dp = dp.transpose()?;
        let tp = (config.tp > 1)
            .then(|| mesh.group("tp").cloned())
            .transpose()?
            .map(|group| config.tensor_parallel(&group));
        let groups = crate::pipeline::Groups {
            pp: mesh.group("pp")?,
            dp: dp.as_ref(),
            tp: tp.as_ref(),
        };
        let (stages, spans) =
            crate::pipeline::train_rank(config, data, init()?, groups, device, forward)?;
        let first_copy = mesh.coord("dp")? == 0 && mesh.coord("tp")? == 0;
        Ok((first_copy, stages, spans))
    })?;
    let mut stages = Vec::new();
    let mut timeline = burn_pipeline::Timeline {
        ranks: Vec::new(),
        virtual_stages: config.virtual_stages,
    };
    // Ranks come back in order, pp before tp: the first copy's are in stage order. A process
    // (one rank per process) holds every stage (see `pipeline::share_stages`).
    for (first_copy, rank_stages, spans) in results {
        if first_copy || config.process.is_some() {
            stages.extend(rank_stages);
            timeline.ranks.push(spans);
        }
    }
    if let Some(path) = &config.schedule_svg {
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
    stages.sort_by_key(|(stage, _)| *stage);
    Ok(LlamaStage::join(
        stages.into_iter().map(|(_, s)| s).collect(),
    ))
}
