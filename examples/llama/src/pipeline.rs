//! The Llama decoder as pipeline stages: its blocks cut into `pp x virtual_stages` contiguous
//! stages of even parameter count, the first holding the embedding and the last the final norm,
//! head and loss. Each rank trains its stages under a burn-pipeline schedule; data-parallel
//! replicas of a stage average their gradients after the pipeline has drained.

use std::fmt;
use std::ops::Range;
use std::time::Instant;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor};
use burn_comm::{CommError, Communicator, ReduceOp};
use burn_ddp::BackwardHooks;
use burn_pipeline::{
    Message, PipelineExecutor, PipelineStage, Schedule, Span, StageOutput, balance,
};
use burn_tensor_parallel::{TensorParallel, TpBackend};
use burn_zero::{ShardedDataParallel, ZeroStage};
use serde::Serialize;

use crate::config::LlamaConfig;
use crate::model::{Block, Llama, Positions, RmsNorm, embed, head, head_weight, next_token_loss};
use crate::tp_stage::TpLlamaStage;
use crate::train::{Batches, StepMetrics, TrainConfig, TrainError, reduce_scalar};
use crate::zero::ZeroStep;

/// A run of consecutive blocks, with the embedding if it is the first stage and the final
/// norm and head if it is the last.
#[derive(Module, Debug)]
pub struct LlamaStage<B: Backend> {
    /// `[vocab, hidden]`, on the first stage.
    pub embed_tokens: Option<Param<Tensor<B, 2>>>,
    /// This stage's blocks.
    pub layers: Vec<Block<B>>,
    /// Final norm, on the last stage.
    pub norm: Option<RmsNorm<B>>,
    /// `[hidden, vocab]`, on the last stage.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    #[module(skip)]
    config: LlamaConfig,
}

/// Inputs and targets of one micro-batch.
pub type MicroBatch<B> = (Tensor<B, 2, Int>, Tensor<B, 2, Int>);

impl<B: AutodiffBackend> PipelineStage<B> for LlamaStage<B> {
    type Batch = MicroBatch<B>;
    type Error = TrainError;

    fn forward(
        &self,
        input: Option<Tensor<B, 3>>,
        (inputs, targets): &MicroBatch<B>,
    ) -> Result<StageOutput<B>, TrainError> {
        let mut x = stage_input(self.embed_tokens.as_ref(), input, |table| {
            Ok(embed(table, inputs.clone()))
        })?;
        let positions = stage_positions(&self.config, targets, &x);
        for layer in &self.layers {
            x = layer.forward(x, &positions);
        }
        let Some(norm) = &self.norm else {
            return Ok(StageOutput::Activation(x));
        };
        let weight = head_weight(self.lm_head.as_ref(), self.embed_tokens.as_ref())
            .ok_or_else(|| TrainError::Config(crate::train::TIED_NOT_SPLIT.into()))?;
        Ok(StageOutput::Loss(next_token_loss(
            head(norm, weight, x),
            targets.clone(),
        )))
    }
}

/// A stage's input: the embedded tokens on the first stage (the one holding `embedding`), the
/// previous stage's activations on every other.
pub(crate) fn stage_input<E, B: Backend>(
    embedding: Option<&E>,
    input: Option<Tensor<B, 3>>,
    embed: impl FnOnce(&E) -> Result<Tensor<B, 3>, TrainError>,
) -> Result<Tensor<B, 3>, TrainError> {
    match (embedding, input) {
        (Some(embedding), None) => embed(embedding),
        (None, Some(x)) => Ok(x),
        _ => Err(TrainError::Config(
            "a pipeline stage got an input it does not take: only the first stage reads tokens"
                .into(),
        )),
    }
}

/// Rotary tables and mask for the whole sequence of `targets` (under sequence parallelism a
/// stage's input holds only part of it), in the dtype of the activations `x`.
pub(crate) fn stage_positions<B: Backend>(
    config: &LlamaConfig,
    targets: &Tensor<B, 2, Int>,
    x: &Tensor<B, 3>,
) -> Positions<B> {
    Positions::new(
        targets.dims()[1],
        config.head_dim(),
        &config.rope(),
        (&x.device(), x.dtype()),
    )
}

/// How the blocks are shared out among the pipeline stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
pub enum Balance {
    /// Even parameter counts, the embedding counting on the first stage and the final norm and
    /// head on the last.
    #[default]
    Params,
    /// Even forward + backward time of a micro-batch, each block, the embedding and the head
    /// timed alone on the first rank before training and shared with every rank.
    Time,
}

impl fmt::Display for Balance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Balance::Params => "params",
            Balance::Time => "time",
        })
    }
}

/// What each block, the embedding, and the final norm with the head and loss cost, in one unit.
#[derive(Debug, Clone, PartialEq)]
pub struct StageCosts {
    /// Each block's.
    pub blocks: Vec<f64>,
    /// The embedding's, on the first stage.
    pub embedding: f64,
    /// The final norm's, head's and loss's, on the last stage.
    pub tail: f64,
}

impl StageCosts {
    /// Parameter counts.
    pub fn params(config: &LlamaConfig) -> Self {
        let (h, v) = (config.hidden_size as f64, config.vocab_size as f64);
        let total = config.num_params() as f64;
        let embedding = v * h;
        let tail = h + h * v;
        let block = (total - embedding - tail) / config.num_hidden_layers as f64;
        Self {
            blocks: vec![block; config.num_hidden_layers],
            embedding,
            tail,
        }
    }

    /// Seconds of forward + backward of `batch` through each part of `model` alone, the fastest
    /// of a few runs after a warm-up.
    pub fn time<B: AutodiffBackend>(
        model: &Llama<B>,
        config: &LlamaConfig,
        (inputs, targets): &MicroBatch<B>,
    ) -> Result<Self, TrainError> {
        const RUNS: usize = 3;
        let device = inputs.device();
        let time = |work: &dyn Fn()| -> Result<f64, TrainError> {
            let mut fastest = f64::INFINITY;
            for run in 0..=RUNS {
                let started = Instant::now();
                work();
                B::sync(&device).map_err(|e| {
                    TrainError::Config(format!("timing the stages failed on the device: {e:?}"))
                })?;
                if run > 0 {
                    fastest = fastest.min(started.elapsed().as_secs_f64());
                }
            }
            Ok(fastest)
        };
        // Every block and the head take the embedding's output, as in training.
        let x = embed(&model.embed_tokens, inputs.clone()).detach();
        let positions = stage_positions(config, targets, &x);
        let embedding = time(&|| {
            embed(&model.embed_tokens, inputs.clone()).sum().backward();
        })?;
        let blocks = model
            .layers
            .iter()
            .map(|block| {
                time(&|| {
                    block
                        .forward(x.clone().require_grad(), &positions)
                        .sum()
                        .backward();
                })
            })
            .collect::<Result<_, _>>()?;
        let tail = time(&|| {
            let logits = head(&model.norm, model.head_weight(), x.clone().require_grad());
            next_token_loss(logits, targets.clone()).backward();
        })?;
        Ok(Self {
            blocks,
            embedding,
            tail,
        })
    }

    /// The blocks of each of `pp x virtual_stages` stages, balancing these costs; an error
    /// says what to change when there are too few blocks.
    pub fn split(&self, pp: usize, virtual_stages: usize) -> Result<Vec<Range<usize>>, TrainError> {
        let stages = pp * virtual_stages;
        balance(&self.blocks, stages, self.embedding, self.tail).map_err(|_| {
            TrainError::Config(format!(
                "--pp {pp} x --virtual-stages {virtual_stages} needs {stages} stages of at least one block, but the model has {} blocks; lower --pp or --virtual-stages",
                self.blocks.len()
            ))
        })
    }

    /// The same costs on every rank: those of the first rank of every group, broadcast.
    fn shared<B: Backend>(
        self,
        groups: Groups<'_>,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let layers = self.blocks.len();
        let values: Vec<f32> = self
            .blocks
            .iter()
            .chain([&self.embedding, &self.tail])
            .map(|&c| c as f32)
            .collect();
        let mut tensor = Tensor::<B, 1>::from_floats(values.as_slice(), device);
        let tp = groups.tp.map(TensorParallel::comm);
        for group in [Some(groups.pp), groups.dp, tp].into_iter().flatten() {
            tensor = group.broadcast(tensor, 0)?;
        }
        let values: Vec<f64> = tensor.into_data().iter::<f32>().map(f64::from).collect();
        Ok(Self {
            blocks: values[..layers].to_vec(),
            embedding: values[layers],
            tail: values[layers + 1],
        })
    }
}

/// The blocks of each of `pp x virtual_stages` stages, balanced by parameter count; an error
/// says what to change when there are too few blocks.
pub fn split(
    config: &LlamaConfig,
    pp: usize,
    virtual_stages: usize,
) -> Result<Vec<Range<usize>>, TrainError> {
    StageCosts::params(config).split(pp, virtual_stages)
}

impl<B: Backend> LlamaStage<B> {
    /// A stage of a model shaped `config`: the embedding table on the first stage, the final
    /// norm and head on the last.
    pub fn new(
        embed_tokens: Option<Tensor<B, 2>>,
        layers: Vec<Block<B>>,
        norm: Option<RmsNorm<B>>,
        lm_head: Option<Tensor<B, 2>>,
        config: LlamaConfig,
    ) -> Self {
        Self {
            embed_tokens: embed_tokens.map(Param::from_tensor),
            layers,
            norm,
            lm_head: lm_head.map(Param::from_tensor),
            config,
        }
    }

    /// The shape of the model this stage is part of.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The stages of `model` holding the blocks in `ranges`, in order.
    pub fn cut(model: Llama<B>, config: &LlamaConfig, ranges: &[Range<usize>]) -> Vec<Self> {
        let last = ranges.len() - 1;
        let mut blocks = model.layers.into_iter();
        let (mut embed_tokens, mut norm, mut lm_head) =
            (Some(model.embed_tokens), Some(model.norm), model.lm_head);
        ranges
            .iter()
            .enumerate()
            .map(|(s, range)| LlamaStage {
                embed_tokens: if s == 0 { embed_tokens.take() } else { None },
                layers: blocks.by_ref().take(range.len()).collect(),
                norm: if s == last { norm.take() } else { None },
                lm_head: if s == last { lm_head.take() } else { None },
                config: config.clone(),
            })
            .collect()
    }

    /// The whole model from all its stages, in order.
    pub fn join(stages: Vec<Self>) -> Llama<B> {
        let mut embed_tokens = None;
        let (mut norm, mut lm_head) = (None, None);
        let mut layers = Vec::new();
        for stage in stages {
            embed_tokens = embed_tokens.or(stage.embed_tokens);
            norm = norm.or(stage.norm);
            lm_head = lm_head.or(stage.lm_head);
            layers.extend(stage.layers);
        }
        Llama {
            embed_tokens: embed_tokens.expect("the first stage has the embedding"),
            layers,
            norm: norm.expect("the last stage has the final norm"),
            lm_head,
        }
    }
}

/// What one pipeline rank hands back: its stages (by stage index), whole, and the timeline of
/// its last step.
pub type RankResult<B> = (Vec<(usize, LlamaStage<B>)>, Vec<Span>);

/// The groups of one pipeline rank: its pipeline, the replicas of its stages (data
/// parallelism), and the tensor-parallel peers sharing its stages.
#[derive(Clone, Copy)]
pub struct Groups<'a> {
    /// One rank per stage group, in stage order.
    pub pp: &'a Communicator,
    /// The replicas of this rank's stages, if any.
    pub dp: Option<&'a Communicator>,
    /// The ranks splitting this rank's stages, if any.
    pub tp: Option<&'a TensorParallel>,
}

impl Groups<'_> {
    /// Whether this is the first rank of every group.
    fn is_first(&self) -> bool {
        self.pp.rank() == 0
            && self.dp.is_none_or(|dp| dp.rank() == 0)
            && self.tp.is_none_or(|tp| tp.rank() == 0)
    }
}

/// Trains this rank's stages of `model` in `groups`.
pub fn train_rank<B: BackwardHooks + TpBackend>(
    config: &TrainConfig,
    data: &dyn crate::data::Dataset,
    model: Llama<B>,
    groups: Groups<'_>,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<RankResult<B::InnerBackend>, TrainError>
where
    B::InnerBackend: TpBackend,
{
    let layout = config.layout()?;
    let schedule = Schedule::new(
        config.schedule,
        config.pp,
        layout.accum,
        config.virtual_stages,
    )?;
    let mut executor =
        PipelineExecutor::new(schedule, groups.pp.clone())?.with_recompute(config.recompute);
    if let Some(tp) = groups.tp {
        executor = executor.with_backward_group(tp.comm().clone());
    }
    let (world, rank) = groups.dp.map_or((1, 0), |c| (c.size(), c.rank()));
    let batches = Batches::new(config, data, world, rank, layout)?;
    let costs = match config.balance {
        Balance::Params => StageCosts::params(&config.model),
        Balance::Time => {
            // The others' costs are placeholders of the right length for the broadcast.
            let measured = if groups.is_first() {
                StageCosts::time(&model, &config.model, &batches.micro(0, 0, device))?
            } else {
                StageCosts::params(&config.model)
            };
            measured.shared::<B::InnerBackend>(groups, device)?
        }
    };
    let ranges = costs.split(config.pp, config.virtual_stages)?;
    let mut stages: Vec<Option<LlamaStage<B>>> = LlamaStage::cut(model, &config.model, &ranges)
        .into_iter()
        .map(Some)
        .collect();
    let mine = executor.stages();
    let chunks: Vec<LlamaStage<B>> = mine
        .iter()
        .map(|&s| stages[s].take().expect("each stage once"))
        .collect();
    // With one process per rank, the other stages are kept as the shapes to receive them into;
    // on threads they are dropped here (the closure owns them), before training.
    let elsewhere: Option<Vec<Option<LlamaStage<B::InnerBackend>>>> = config
        .process
        .as_ref()
        .map(|_| stages.into_iter().map(|s| s.map(|s| s.valid())).collect());

    // Under sequence parallelism each tensor-parallel rank sends its part of the sequence.
    let sequence_parts = match groups.tp {
        Some(tp) if tp.sequence_parallel() => tp.size(),
        _ => 1,
    };
    // The stages compute, and so send, in their parameters' dtype.
    let dtype = config
        .zero_config
        .precision
        .as_ref()
        .map_or(DType::F32, |p| p.param_dtype);
    let message = Message::new(
        [
            layout.micro,
            config.seq_len / sequence_parts,
            config.model.hidden_size,
        ],
        dtype,
    );
    let run = Run {
        config,
        executor: &executor,
        batches: &batches,
        message,
        groups,
        device,
    };
    let (chunks, spans) = match groups.tp {
        None => {
            let (chunks, spans) = run.train(chunks, on_step)?;
            let chunks: Vec<_> = chunks.into_iter().map(|c| c.valid()).collect();
            (chunks, spans)
        }
        Some(tp) => {
            let chunks = chunks
                .into_iter()
                .map(|chunk| TpLlamaStage::from_stage(chunk, tp))
                .collect::<Result<Vec<_>, _>>()?;
            let (chunks, spans) = run.train(chunks, on_step)?;
            let chunks = chunks
                .into_iter()
                .map(|chunk| chunk.valid().full())
                .collect::<Result<Vec<_>, _>>()?;
            (chunks, spans)
        }
    };
    let trained = mine.into_iter().zip(chunks).collect();
    match elsewhere {
        None => Ok((trained, spans)),
        Some(elsewhere) => {
            let whole = share_stages(groups.pp, executor.schedule(), trained, elsewhere)?;
            Ok((whole, spans))
        }
    }
}

/// With one process per rank, the stages trained on other ranks are not in this process: each
/// pipeline rank broadcasts its stages to the rest of its pipeline, so every rank ends with the
/// whole model, as the threads' run does (replicas and tensor-parallel peers hold the same
/// stages). `elsewhere` holds the other stages' shapes. Weights travel as f32.
fn share_stages<B: Backend>(
    pp: &Communicator,
    schedule: &Schedule,
    trained: Vec<(usize, LlamaStage<B>)>,
    mut elsewhere: Vec<Option<LlamaStage<B>>>,
) -> Result<Vec<(usize, LlamaStage<B>)>, TrainError> {
    for (s, stage) in trained {
        elsewhere[s] = Some(stage);
    }
    elsewhere
        .into_iter()
        .enumerate()
        .map(|(s, stage)| {
            let stage = stage.expect("every stage is trained here or kept as a shape");
            let mut from_owner = FromOwner {
                comm: pp,
                root: schedule.rank_of(s),
                failed: None,
            };
            let stage = stage.map(&mut from_owner);
            match from_owner.failed {
                None => Ok((s, stage)),
                Some(error) => Err(error.into()),
            }
        })
        .collect()
}

/// Replaces every float parameter by the `root` rank's, in f32.
struct FromOwner<'a> {
    comm: &'a Communicator,
    root: usize,
    /// The first failure; the later parameters are left as they are.
    failed: Option<CommError>,
}

impl<B: Backend> ModuleMapper<B> for FromOwner<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.map(|tensor| {
            if self.failed.is_some() {
                return tensor;
            }
            match self
                .comm
                .broadcast(tensor.clone().cast(DType::F32), self.root)
            {
                Ok(value) => value,
                Err(error) => {
                    self.failed = Some(error);
                    tensor
                }
            }
        })
    }
}

/// What every step of one rank's training shares.
struct Run<'a, B: AutodiffBackend> {
    config: &'a TrainConfig,
    executor: &'a PipelineExecutor,
    batches: &'a Batches<'a>,
    message: Message,
    groups: Groups<'a>,
    device: &'a B::Device,
}

impl<B: BackwardHooks> Run<'_, B> {
    /// Trains `chunks`, this rank's stages, for the configured steps; returns them with the
    /// timeline of the last step.
    fn train<S>(
        &self,
        chunks: Vec<S>,
        on_step: &mut dyn FnMut(&StepMetrics),
    ) -> Result<(Vec<S>, Vec<Span>), TrainError>
    where
        S: PipelineStage<B, Batch = MicroBatch<B>, Error = TrainError>,
    {
        let Self {
            config,
            executor,
            batches,
            message,
            groups,
            device,
        } = *self;
        let (pp, dp) = (groups.pp, groups.dp);
        let mut stepper = Stepper::new(chunks, config, dp)?;
        let schedule = config.schedule();
        let tokens = config.batch_size * config.seq_len;
        let started = Instant::now();
        let mut spans = Vec::new();
        for step in 0..config.steps {
            let micro_batches: Vec<MicroBatch<B>> = (0..executor.schedule().micro_batches)
                .map(|mb| batches.micro(step, mb, device))
                .collect();
            pp.barrier()?;
            let begun = Instant::now();
            let loss_scale = stepper.loss_scale();
            let out = executor.step(
                stepper.chunks(),
                &micro_batches,
                message,
                loss_scale,
                device,
                begun,
            )?;
            let (wait, zero) = stepper.step(out.grads, loss_scale, schedule.lr(step), dp)?;
            // The last stage's rank knows the loss; the sum over the group hands it to all.
            let loss = out.loss.unwrap_or(0.0);
            let mut loss = reduce_scalar::<B::InnerBackend>(pp, loss, ReduceOp::Sum, device)?;
            if let Some(dp) = dp {
                loss = reduce_scalar::<B::InnerBackend>(dp, loss, ReduceOp::Avg, device)?;
            }
            let lr = schedule.lr(step);
            let mut metrics = StepMetrics::measure(step, loss, lr, tokens, (begun, started), wait);
            if let Some(zero) = zero {
                zero.fill(&mut metrics);
            }
            on_step(&metrics);
            spans = out.spans;
        }
        Ok((stepper.into_chunks()?, spans))
    }
}

/// How a pipeline rank steps its chunks: burn's AdamW on gradients averaged over the
/// replicas, or ZeRO-1, whose optimizer state is sharded over them.
enum Stepper<B: BackwardHooks, S: AutodiffModule<B>> {
    Replicated {
        chunks: Vec<S>,
        optimizer: OptimizerAdaptor<AdamW, Vec<S>, B>,
    },
    Zero(Box<ShardedDataParallel<B, Vec<S>>>),
}

impl<B: BackwardHooks, S: AutodiffModule<B>> Stepper<B, S> {
    fn new(
        chunks: Vec<S>,
        config: &TrainConfig,
        dp: Option<&Communicator>,
    ) -> Result<Self, TrainError> {
        Ok(match (config.zero, dp) {
            (ZeroStage::Replicated, _) => Self::Replicated {
                chunks,
                optimizer: config.optimizer().init::<B, Vec<S>>(),
            },
            (stage, Some(dp)) => Self::Zero(Box::new(ShardedDataParallel::new(
                chunks,
                dp.clone(),
                stage,
                &config.optimizer(),
                config.zero_engine_config(),
            )?)),
            (_, None) => {
                return Err(TrainError::Config(
                    "ZeRO shards over the data-parallel group; use --strategy ddp".into(),
                ));
            }
        })
    }

    /// What the pipeline multiplies its losses by before their backward (f16 loss scaling).
    fn loss_scale(&self) -> f64 {
        match self {
            Self::Replicated { .. } => 1.0,
            Self::Zero(zero) => zero.loss_scale().unwrap_or(1.0),
        }
    }

    fn chunks(&self) -> &Vec<S> {
        match self {
            Self::Replicated { chunks, .. } => chunks,
            Self::Zero(zero) => zero.module(),
        }
    }

    /// Steps with the pipeline's gradients (of its losses times `loss_scale`), reduced over
    /// `dp` first; returns the time spent reducing and, under ZeRO, what it adds to the metrics.
    fn step(
        &mut self,
        grads: GradientsParams,
        loss_scale: f64,
        lr: f64,
        dp: Option<&Communicator>,
    ) -> Result<(f64, Option<ZeroStep>), TrainError> {
        match self {
            Self::Replicated { chunks, optimizer } => {
                let mut grads = grads;
                let mut wait = 0.0;
                if let Some(dp) = dp {
                    let waited = Instant::now();
                    grads = average(grads, chunks, dp)?;
                    wait = waited.elapsed().as_secs_f64();
                }
                *chunks = optimizer.step(lr, std::mem::take(chunks), grads);
                Ok((wait, None))
            }
            Self::Zero(zero) => {
                zero.add_gradients(grads, loss_scale)?;
                let wait = zero.stats().comm_wait.as_secs_f64();
                Ok((wait, Some(ZeroStep::sharded(zero, lr)?)))
            }
        }
    }

    fn into_chunks(self) -> Result<Vec<S>, TrainError> {
        match self {
            Self::Replicated { chunks, .. } => Ok(chunks),
            Self::Zero(zero) => Ok(zero.master_module()?),
        }
    }
}

/// The gradients of `chunks` averaged over the replicas in `dp`, one parameter at a time in the
/// modules' order (the same on every replica).
fn average<B: AutodiffBackend, M: Module<B>>(
    grads: GradientsParams,
    chunks: &[M],
    dp: &Communicator,
) -> Result<GradientsParams, CommError> {
    struct Averager<'a> {
        grads: GradientsParams,
        dp: &'a Communicator,
        error: Option<CommError>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Averager<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.error.is_some() {
                return;
            }
            let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
                return;
            };
            match self.dp.all_reduce(grad, ReduceOp::Avg) {
                Ok(avg) => self.grads.register(param.id, avg),
                Err(e) => self.error = Some(e),
            }
        }
    }
    let mut averager = Averager {
        grads,
        dp,
        error: None,
    };
    for chunk in chunks {
        chunk.visit(&mut averager);
    }
    match averager.error {
        Some(e) => Err(e),
        None => Ok(averager.grads),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn_comm::DeviceMesh;

    #[test]
    fn every_rank_gets_the_first_ranks_costs() {
        let results = burn_comm::launch(8, |ctx| {
            let mesh = DeviceMesh::new(ctx.world(), &[("dp", 2), ("pp", 2), ("tp", 2)])?;
            let tp = TensorParallel::new(mesh.group("tp")?.clone());
            let groups = Groups {
                pp: mesh.group("pp")?,
                dp: Some(mesh.group("dp")?),
                tp: Some(&tp),
            };
            let mine = ctx.rank() as f64;
            let costs = StageCosts {
                blocks: vec![mine + 1.0, 2.0 * mine],
                embedding: mine,
                tail: 3.0 + mine,
            };
            Ok::<_, TrainError>((
                groups.is_first(),
                costs.shared::<Flex>(groups, &Default::default())?,
            ))
        });
        for (rank, result) in results.into_iter().enumerate() {
            let (first, costs) = result.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(first, rank == 0);
            assert_eq!(costs.blocks, vec![1.0, 0.0], "rank {rank}");
            assert_eq!((costs.embedding, costs.tail), (0.0, 3.0), "rank {rank}");
        }
    }

    #[test]
    fn an_expensive_head_gets_a_stage_with_fewer_blocks() {
        let costs = StageCosts {
            blocks: vec![1.0; 8],
            embedding: 0.0,
            tail: 2.0,
        };
        assert_eq!(costs.split(2, 1).unwrap(), vec![0..5, 5..8]);
        let err = costs.split(3, 3).unwrap_err().to_string();
        assert!(
            err.contains("needs 9 stages") && err.contains("8 blocks"),
            "{err}"
        );
    }
}
