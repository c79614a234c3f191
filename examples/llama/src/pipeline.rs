//! The Llama decoder as pipeline stages: its blocks cut into `pp x virtual_stages` contiguous
//! stages of even parameter count, the first holding the embedding and the last the final norm,
//! head and loss. Each rank trains its stages under a burn-pipeline schedule; data-parallel
//! replicas of a stage average their gradients after the pipeline has drained.

use std::ops::Range;
use std::time::Instant;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};
use burn_comm::{CommError, Communicator, ReduceOp};
use burn_pipeline::{PipelineExecutor, PipelineStage, Schedule, Span, StageOutput, balance};

use crate::config::LlamaConfig;
use crate::model::{Block, Llama, Positions, RmsNorm, embed, head, next_token_loss};
use crate::train::{Batches, StepMetrics, TrainConfig, TrainError, reduce_scalar};

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
        let mut x = match (&self.embed_tokens, input) {
            (Some(table), None) => embed(table, inputs.clone()),
            (None, Some(x)) => x,
            _ => {
                return Err(TrainError::Config(
                    "a pipeline stage got an input it does not take: only the first stage reads tokens".into(),
                ));
            }
        };
        let positions = Positions::new(
            x.dims()[1],
            self.config.head_dim(),
            self.config.rope_theta,
            &x.device(),
        );
        for layer in &self.layers {
            x = layer.forward(x, &positions);
        }
        Ok(match (&self.norm, &self.lm_head) {
            (Some(norm), Some(lm_head)) => {
                StageOutput::Loss(next_token_loss(head(norm, lm_head, x), targets.clone()))
            }
            _ => StageOutput::Activation(x),
        })
    }
}

/// Parameters of each block, of the embedding and of the norm and head: what the split
/// balances.
fn costs(config: &LlamaConfig) -> (Vec<f64>, f64, f64) {
    let (h, v) = (config.hidden_size as f64, config.vocab_size as f64);
    let total = config.num_params() as f64;
    let embedding = v * h;
    let tail = h + h * v;
    let block = (total - embedding - tail) / config.num_hidden_layers as f64;
    (vec![block; config.num_hidden_layers], embedding, tail)
}

/// The blocks of each of `stages` stages, balanced by parameter count; an error says what to
/// change when there are too few blocks.
pub fn split(
    config: &LlamaConfig,
    pp: usize,
    virtual_stages: usize,
) -> Result<Vec<Range<usize>>, TrainError> {
    let (blocks, embedding, tail) = costs(config);
    balance(&blocks, pp * virtual_stages, embedding, tail).map_err(|_| {
        TrainError::Config(format!(
            "--pp {pp} x --virtual-stages {virtual_stages} needs {} stages of at least one block, but the model has {} blocks; lower --pp or --virtual-stages",
            pp * virtual_stages,
            config.num_hidden_layers
        ))
    })
}

impl<B: Backend> LlamaStage<B> {
    /// The stages of `model` holding the blocks in `ranges`, in order.
    pub fn cut(model: Llama<B>, config: &LlamaConfig, ranges: &[Range<usize>]) -> Vec<Self> {
        let last = ranges.len() - 1;
        let mut blocks = model.layers.into_iter();
        let (mut embed_tokens, mut norm, mut lm_head) = (
            Some(model.embed_tokens),
            Some(model.norm),
            Some(model.lm_head),
        );
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
            lm_head: lm_head.expect("the last stage has the head"),
        }
    }
}

/// What one pipeline rank hands back: its stages (by stage index) and the timeline of its last
/// step.
pub type RankResult<B> = (Vec<(usize, LlamaStage<B>)>, Vec<Span>);

/// Trains this rank's stages of `model`: `pp` is the pipeline group, `dp` the group of the
/// replicas of the same stages (if any).
#[allow(clippy::too_many_arguments)]
pub fn train_rank<B: AutodiffBackend>(
    config: &TrainConfig,
    data: &dyn crate::data::Dataset,
    model: Llama<B>,
    pp: &Communicator,
    dp: Option<&Communicator>,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<RankResult<B::InnerBackend>, TrainError> {
    let layout = config.layout()?;
    let schedule = Schedule::new(
        config.schedule,
        config.pp,
        layout.accum,
        config.virtual_stages,
    )?;
    let executor = PipelineExecutor::new(schedule, pp.clone())?.with_recompute(config.recompute);
    let ranges = split(&config.model, config.pp, config.virtual_stages)?;
    let mut stages: Vec<Option<LlamaStage<B>>> = LlamaStage::cut(model, &config.model, &ranges)
        .into_iter()
        .map(Some)
        .collect();
    let mine = executor.stages();
    let mut chunks: Vec<LlamaStage<B>> = mine
        .iter()
        .map(|&s| stages[s].take().expect("each stage once"))
        .collect();
    drop(stages);

    let (world, rank) = dp.map_or((1, 0), |c| (c.size(), c.rank()));
    let batches = Batches::new(config, data, world, rank, layout)?;
    let mut optimizer = config.optimizer().init::<B, Vec<LlamaStage<B>>>();
    let schedule = config.schedule();
    let tokens = config.batch_size * config.seq_len;
    let message = [layout.micro, config.seq_len, config.model.hidden_size];
    let started = Instant::now();
    let mut spans = Vec::new();
    for step in 0..config.steps {
        let micro_batches: Vec<MicroBatch<B>> = (0..layout.accum)
            .map(|mb| batches.micro(step, mb, device))
            .collect();
        pp.barrier()?;
        let begun = Instant::now();
        let out = executor.step(&chunks, &micro_batches, message, device, begun)?;
        let mut grads = out.grads;
        let mut wait = 0.0;
        if let Some(dp) = dp {
            let waited = Instant::now();
            grads = average(grads, &chunks, dp)?;
            wait = waited.elapsed().as_secs_f64();
        }
        chunks = optimizer.step(schedule.lr(step), chunks, grads);
        // The last stage's rank knows the loss; the sum over the group hands it to all.
        let loss = out.loss.unwrap_or(0.0);
        let mut loss = reduce_scalar::<B::InnerBackend>(pp, loss, ReduceOp::Sum, device)?;
        if let Some(dp) = dp {
            loss = reduce_scalar::<B::InnerBackend>(dp, loss, ReduceOp::Avg, device)?;
        }
        let lr = schedule.lr(step);
        on_step(&StepMetrics::measure(
            step,
            loss,
            lr,
            tokens,
            (begun, started),
            wait,
        ));
        spans = out.spans;
    }
    let stages = mine
        .into_iter()
        .zip(chunks)
        .map(|(s, chunk)| (s, chunk.valid()))
        .collect();
    Ok((stages, spans))
}

/// The gradients of `chunks` averaged over the replicas in `dp`, one parameter at a time in the
/// modules' order (the same on every replica).
fn average<B: AutodiffBackend>(
    grads: GradientsParams,
    chunks: &[LlamaStage<B>],
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
