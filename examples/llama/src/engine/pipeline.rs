//! Pipeline parallelism: each rank trains its stages under a burn-pipeline schedule; the
//! replicas of a stage (data parallelism) average its gradients in DDP's buckets, each chunk's
//! starting during its last backward, or shard its optimizer state (ZeRO-1). A head tied to
//! the embedding holds a copy on the last stage whose gradient is summed with the first's. At
//! the end every rank of a pipeline hands its stages to the others, so each holds the whole
//! model.

use std::time::Instant;

use burn::module::{AutodiffModule, Module, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, GradientsParams, Optimizer};
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_checkpoint::Checkpoint;
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::{BackwardHooks, ExpertGroup, GradientSync};
use burn_pipeline::{
    Accumulate, Message, PipelineExecutor, PipelineStage, Schedule, Span, StepRun,
};
use burn_zero::{ShardedDataParallel, ZeroStage};

use super::{Engine, Finished, Stepped, TrainBackend, ZeroStep};
use crate::batches::Batches;
use crate::checkpoint::{self, TrainingState};
use crate::dims::Groups;
use crate::model::Llama;
use crate::parallel_plan::ParallelPlan;
use crate::pipeline::{Balance, MicroBatch, StageCosts, share_stages};
use crate::train::{TrainConfig, TrainError};
use crate::weights::Weights;

pub(crate) struct PipelineEngine<'a, B: TrainBackend> {
    config: &'a TrainConfig,
    plan: &'a ParallelPlan,
    executor: PipelineExecutor,
    stepper: Stepper<B, Llama<B>>,
    pp: Communicator,
    dp: Option<Communicator>,
    /// The stages this rank trains, by index, in the order of its chunks.
    mine: Vec<usize>,
    /// The blocks of every stage.
    ranges: Vec<std::ops::Range<usize>>,
    message: Message,
    /// The step's micro-batches and the instant its clock started, from `prepare`.
    prepared: Option<(Vec<MicroBatch<B>>, Instant)>,
    /// The timeline of the last step.
    spans: Vec<Span>,
}

impl<'a, B: TrainBackend> PipelineEngine<'a, B> {
    pub fn new(
        config: &'a TrainConfig,
        plan: &'a ParallelPlan,
        weights: &Weights,
        groups: &Groups,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let accum = batches.micro_batches();
        let schedule = Schedule::new(config.schedule, config.pp, accum, config.virtual_stages)?;
        let pp = groups.pp.clone().expect("a pipeline has its group");
        let mut executor =
            PipelineExecutor::new(schedule, pp.clone())?.with_recompute(config.recompute);
        if let Some(peers) = &groups.stage_peers {
            executor = executor.with_backward_group(peers.clone());
        }
        let ranges = match config.balance {
            Balance::Params => plan.stages.clone(),
            Balance::Time => {
                // The others' costs are placeholders of the right length for the broadcast.
                let measured = if groups.is_first() {
                    let whole = weights.whole::<B>(&config.model, device)?;
                    StageCosts::time(&whole, &config.model, &batches.micro(0, 0, device))?
                } else {
                    StageCosts::params(&config.model)
                };
                measured
                    .shared::<B::InnerBackend>(groups, device)?
                    .split(config.pp, config.virtual_stages)?
            }
        };
        let mine = executor.stages();
        // The stages trained elsewhere are never built.
        let chunks = weights
            .parts(&config.model, plan, &ranges, &mine, groups.slices(), device)?
            .into_iter()
            .map(|chunk| groups.set_up(chunk))
            .collect::<Vec<_>>();
        let experts = super::expert_group(groups, &chunks);
        // Each context-parallel rank sends its part of the sequence, and under sequence
        // parallelism each tensor-parallel rank its part of that.
        let sequence_parts = config.cp
            * match &groups.tp {
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
                batches.micro_batch_size(),
                config.seq_len / sequence_parts,
                config.model.hidden_size,
            ],
            dtype,
        );
        let tied = TiedEmbedding::new(config, &pp, &chunks)?;
        Ok(Self {
            config,
            plan,
            executor,
            stepper: Stepper::new(chunks, config, groups, tied, experts)?,
            pp,
            dp: groups.replicas.clone(),
            mine,
            ranges,
            message,
            prepared: None,
            spans: Vec::new(),
        })
    }
}

impl<B: TrainBackend> Engine<B> for PipelineEngine<'_, B> {
    fn prepare(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<(), TrainError> {
        let micro_batches = (0..self.executor.schedule().micro_batches)
            .map(|mb| batches.micro(step, mb, device))
            .collect();
        // The timeline starts together on every rank of the pipeline.
        self.pp.barrier()?;
        self.prepared = Some((micro_batches, Instant::now()));
        Ok(())
    }

    fn forward_backward(
        &mut self,
        _step: usize,
        _batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        let (micro_batches, begun) = self.prepared.take().expect("prepare ran first");
        let run = self
            .stepper
            .run(&self.executor, &micro_batches, self.message, device, begun)?;
        self.spans = run.spans;
        // The last stage's rank knows the loss; the sum over the pipeline hands it to all.
        Ok(run.loss.unwrap_or(0.0))
    }

    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        self.stepper.step(lr)
    }

    fn checkpoint_pieces(&self) -> Result<TrainingState, TrainError> {
        self.stepper.checkpoint_pieces(self.plan)
    }

    fn restore(&mut self, from: &Checkpoint, device: &B::Device) -> Result<(), TrainError> {
        self.stepper.restore(self.plan, self.config, from, device)
    }

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        let mut groups = vec![(self.pp.clone(), ReduceOp::Sum)];
        groups.extend(self.dp.iter().map(|dp| (dp.clone(), ReduceOp::Avg)));
        groups
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        let Self {
            config,
            plan,
            executor,
            stepper,
            pp,
            mine,
            ranges,
            spans,
            ..
        } = *self;
        let trained = stepper
            .into_chunks()?
            .into_iter()
            .map(|chunk| plan.gather(chunk.valid()))
            .collect::<Result<Vec<_>, _>>()?;
        // The other stages' shapes, to receive them into.
        let device = trained
            .first()
            .map(|stage| stage.devices()[0].clone())
            .expect("every pipeline rank trains a stage");
        let mut elsewhere: Vec<Option<Llama<B::InnerBackend>>> =
            Llama::skeleton(&config.model, &device)
                .cut(&ranges)
                .into_iter()
                .map(Some)
                .collect();
        for &s in &mine {
            elsewhere[s] = None;
        }
        let whole = share_stages(
            &pp,
            executor.schedule(),
            mine.into_iter().zip(trained).collect(),
            elsewhere,
        )?;
        Ok(Finished {
            model: Llama::join(whole.into_iter().map(|(_, stage)| stage).collect()),
            spans,
        })
    }
}

/// How a pipeline rank steps its chunks: burn's AdamW on gradients averaged over the
/// replicas (DDP's buckets, each chunk's started during its last backward), or ZeRO-1, whose
/// optimizer state is sharded over them.
enum Stepper<B: BackwardHooks, S: AutodiffModule<B>> {
    Replicated {
        chunks: Vec<S>,
        optimizer: OptimizerAdaptor<AdamW, Vec<S>, B>,
        /// The replicas' gradient averaging; none without data parallelism.
        sync: Option<Box<GradientSync<B>>>,
        /// The step's gradients and the time spent waiting for their averaging after the
        /// pipeline drained, between `run` and `step`.
        grads: Option<(GradientsParams, f64)>,
        tied: Option<TiedEmbedding>,
    },
    Zero {
        zero: Box<ShardedDataParallel<B, Vec<S>>>,
        tied: Option<TiedEmbedding>,
    },
}

impl<B: BackwardHooks, S: PipelineStage<B, Error = TrainError>> Stepper<B, S> {
    /// `experts`: the chunks' weights held by some replicas only (expert parallelism).
    fn new(
        chunks: Vec<S>,
        config: &TrainConfig,
        groups: &Groups,
        tied: Option<TiedEmbedding>,
        experts: Option<ExpertGroup>,
    ) -> Result<Self, TrainError> {
        Ok(match (config.zero, groups.replicas.as_ref()) {
            (ZeroStage::Replicated, _) => {
                let sync = groups
                    .replicas
                    .as_ref()
                    .map(|dp| {
                        GradientSync::with_experts(&chunks, dp.clone(), experts, config.ddp.clone())
                    })
                    .transpose()?
                    .map(Box::new);
                Self::Replicated {
                    chunks,
                    optimizer: config.optimizer().init::<B, Vec<S>>(),
                    sync,
                    grads: None,
                    tied,
                }
            }
            (stage, Some(dp)) => {
                let mut zero = ShardedDataParallel::new(
                    chunks,
                    dp.clone(),
                    stage,
                    &config.optimizer(),
                    config.zero_engine_config(),
                )?;
                // Every stage skips the same steps for overflow and keeps one loss scale: the
                // last stage scales the loss that every stage's gradients come from.
                if let Some(world) = &groups.world {
                    zero = zero.with_overflow_group(world.clone());
                }
                Self::Zero {
                    zero: Box::new(zero),
                    tied,
                }
            }
            (_, None) => {
                return Err(TrainError::Config(
                    "ZeRO shards over the data-parallel group; use --strategy ddp".into(),
                ));
            }
        })
    }

    /// Runs the step's pipeline, its gradients going where this stepper wants them.
    fn run(
        &mut self,
        executor: &PipelineExecutor,
        micro_batches: &[S::Batch],
        message: Message,
        device: &B::Device,
        begun: Instant,
    ) -> Result<StepRun, TrainError> {
        match self {
            Self::Replicated {
                chunks,
                sync: Some(sync),
                grads,
                tied,
                ..
            } => {
                let mut step = sync.begin(chunks)?;
                let run =
                    executor.step_into(chunks, micro_batches, message, device, begun, &mut step)?;
                let waited = Instant::now();
                let mut averaged = step.finish()?;
                TiedEmbedding::sum::<B>(tied, &mut averaged)?;
                *grads = Some((averaged, waited.elapsed().as_secs_f64()));
                Ok(run)
            }
            Self::Replicated {
                chunks,
                sync: None,
                grads,
                tied,
                ..
            } => {
                let mut sum = Accumulate::new(1.0);
                let run =
                    executor.step_into(chunks, micro_batches, message, device, begun, &mut sum)?;
                let mut summed = sum.grads();
                TiedEmbedding::sum::<B>(tied, &mut summed)?;
                *grads = Some((summed, 0.0));
                Ok(run)
            }
            Self::Zero { zero, tied } => {
                // ZeRO reduces the whole sum once the pipeline has drained.
                let loss_scale = zero.loss_scale().unwrap_or(1.0);
                let mut sum = Accumulate::new(loss_scale);
                let run = executor.step_into(
                    zero.module(),
                    micro_batches,
                    message,
                    device,
                    begun,
                    &mut sum,
                )?;
                let mut summed = sum.grads();
                TiedEmbedding::sum::<B>(tied, &mut summed)?;
                zero.add_gradients(summed, loss_scale)?;
                Ok(run)
            }
        }
    }

    /// Steps with the gradients of the last `run`.
    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        match self {
            Self::Replicated {
                chunks,
                optimizer,
                grads,
                ..
            } => {
                let (grads, wait) = grads.take().expect("run came first");
                *chunks = optimizer.step(lr, std::mem::take(chunks), grads);
                Ok(Stepped {
                    comm_wait_s: wait,
                    ..Stepped::default()
                })
            }
            Self::Zero { zero, .. } => {
                let wait = zero.stats().comm_wait.as_secs_f64();
                Ok(Stepped {
                    comm_wait_s: wait,
                    zero: Some(ZeroStep::sharded(zero, lr)?),
                    grad_norm: None,
                })
            }
        }
    }

    fn into_chunks(self) -> Result<Vec<S>, TrainError> {
        match self {
            Self::Replicated { chunks, .. } => Ok(chunks),
            Self::Zero { zero, .. } => Ok(zero.master_module()?),
        }
    }
}

impl<B: TrainBackend> Stepper<B, Llama<B>> {
    /// Where this rank's chunks sit in the whole model.
    fn held<'a>(plan: &'a ParallelPlan, chunks: &'a [Llama<B>]) -> checkpoint::Held<'a> {
        let first_layers = chunks.iter().map(|c| c.part().layers.start).collect();
        let at = chunks
            .first()
            .map(|c| c.part().slices())
            .unwrap_or_default();
        checkpoint::Held::parts(plan, first_layers, at)
    }

    /// This rank's pieces of the training state: its chunks' parameters and moments.
    fn checkpoint_pieces(&self, plan: &ParallelPlan) -> Result<TrainingState, TrainError> {
        match self {
            Self::Replicated {
                chunks, optimizer, ..
            } => checkpoint::adamw_pieces(&Self::held(plan, chunks), chunks, optimizer),
            Self::Zero { zero, .. } => {
                checkpoint::zero_pieces(&Self::held(plan, zero.module()), zero.shard_tensors())
            }
        }
    }

    /// The optimizer's state from `from` (the chunks were built from it).
    fn restore(
        &mut self,
        plan: &ParallelPlan,
        config: &TrainConfig,
        from: &Checkpoint,
        device: &B::Device,
    ) -> Result<(), TrainError> {
        match self {
            Self::Replicated {
                chunks, optimizer, ..
            } => {
                let fresh = config.optimizer().init::<B, Vec<Llama<B>>>();
                let old = std::mem::replace(optimizer, fresh);
                let held = Self::held(plan, chunks);
                *optimizer = checkpoint::load_adamw(&held, chunks, old, from, device)?;
            }
            Self::Zero { zero, .. } => {
                let held = Self::held(plan, zero.module());
                let moments = checkpoint::zero_moments(&held, &zero.shard_ranges(), from)?;
                let steps = checkpoint::adam_steps(from)?;
                zero.restore_state(moments.as_ref(), steps, checkpoint::loss_scale(from)?)?;
            }
        }
        Ok(())
    }
}

/// A tied head's embedding under a pipeline: the first stage holds it for the tokens, the
/// last a copy (same id) for the head. Their gradients are summed between the two ranks
/// (Megatron's embedding group), so both copies take the same steps and stay equal.
struct TiedEmbedding {
    /// The ranks of the first and the last stage.
    group: Communicator,
    id: ParamId,
}

impl TiedEmbedding {
    /// The group of this pipeline rank's copy, when the model is tied and the rank holds one;
    /// every rank of the pipeline takes part in making it.
    fn new<B: TrainBackend>(
        config: &TrainConfig,
        pp: &Communicator,
        chunks: &[Llama<B>],
    ) -> Result<Option<Self>, TrainError> {
        if !config.model.tie_word_embeddings {
            return Ok(None);
        }
        let ids: Vec<ParamId> = chunks
            .iter()
            .filter_map(|chunk| chunk.embed_tokens.as_ref().map(|table| table.id))
            .collect();
        let group = pp.split("tied-embedding", ids.len().min(1))?;
        match ids[..] {
            [] => Ok(None),
            [id] if group.size() == 2 => Ok(Some(Self { group, id })),
            _ => Err(TrainError::Config(format!(
                "pipeline rank {} holds {} copies of the tied embedding among {} ranks; the first and the last stage must be on two ranks",
                pp.rank(),
                ids.len(),
                group.size()
            ))),
        }
    }

    /// Sums this rank's gradient of the embedding with the other copy's, when it has one.
    fn sum<B: AutodiffBackend>(
        tied: &Option<Self>,
        grads: &mut GradientsParams,
    ) -> Result<(), TrainError> {
        let Some(tied) = tied else {
            return Ok(());
        };
        let grad = grads.remove::<B::InnerBackend, 2>(tied.id).ok_or_else(|| {
            TrainError::Config("the tied embedding got no gradient on this pipeline rank".into())
        })?;
        grads.register(tied.id, tied.group.all_reduce(grad, ReduceOp::Sum)?);
        Ok(())
    }
}
