//! Replays one rank's actions of a [`Schedule`] on real model chunks, sending activations and
//! gradients over burn-comm, and hands the weight gradients to a [`GradientSink`] (by default
//! [`Accumulate`], their sum over the micro-batches).
//!
//! burn has no backward that starts from a given output gradient, so a stage's backward is the
//! backward of `sum(output * received_gradient)`, whose gradient with respect to the output is
//! exactly the received one. The last stage backward its loss divided by the number of
//! micro-batches, as gradient accumulation on one device does, and multiplied by the step's
//! loss scale (f16 training), so every gradient sent between stages is scaled too.
//!
//! Zero-bubble's two halves: the input half runs backward through a forward made with the
//! weights frozen, so burn computes no weight gradient; the weight half runs the forward again
//! from the stored input, detached, and backward through the weights only. burn cannot take
//! two partial backwards of one graph, so the weight half pays one extra forward.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_comm::Communicator;

use crate::PipelineError;
use crate::gradients::{Accumulate, GradientSink};
use crate::schedule::{Action, Kind, Schedule};
use crate::simulate::Span;

/// One chunk of the model as a pipeline stage: some layers, plus the embedding on the first
/// stage and the head and loss on the last.
pub trait PipelineStage<B: AutodiffBackend>: AutodiffModule<B> {
    /// What the first and last stages read of a micro-batch (tokens, targets).
    type Batch;
    /// What the stage's forward fails with; pipeline failures convert into it.
    type Error: From<PipelineError>;

    /// `input` is the previous stage's output, `None` on the first stage. Returns the
    /// activations for the next stage, or the micro-batch's mean loss on the last one.
    fn forward(
        &self,
        input: Option<Tensor<B, 3>>,
        batch: &Self::Batch,
    ) -> Result<StageOutput<B>, Self::Error>;
}

/// What a stage's forward gives.
#[derive(Debug, Clone)]
pub enum StageOutput<B: Backend> {
    /// Activations for the next stage.
    Activation(Tensor<B, 3>),
    /// Activations for the next stage, and a loss this stage adds to the model's itself (one
    /// element, such as a mixture of experts' balancing losses): its gradient joins the
    /// stage's backward, weighted as the last stage's loss is (micro-batches, loss scale).
    ActivationAndLoss(Tensor<B, 3>, Tensor<B, 1>),
    /// The micro-batch's loss (one element), on the last stage.
    Loss(Tensor<B, 1>),
}

impl<B: Backend> StageOutput<B> {
    /// The activations for the next stage and the loss this stage adds, if any; none for the
    /// last stage's loss.
    pub fn into_activation(self) -> Option<(Tensor<B, 3>, Option<Tensor<B, 1>>)> {
        match self {
            Self::Activation(y) => Some((y, None)),
            Self::ActivationAndLoss(y, loss) => Some((y, Some(loss))),
            Self::Loss(_) => None,
        }
    }

    /// The scalar whose backward gives the stage's gradients: the loss times `weight`, or, for
    /// activations whose gradient is `grad`, `sum(y * grad)` plus the stage's own loss times
    /// `weight`. None for activations without a gradient.
    pub fn backward_target(self, grad: Option<Tensor<B, 3>>, weight: f64) -> Option<Tensor<B, 1>> {
        let output = match self {
            Self::Loss(loss) => return Some(loss * weight),
            output => output,
        };
        match (output.into_activation(), grad) {
            (None, _) | (Some(_), None) => None,
            (Some((y, own)), Some(g)) => {
                let target = (y * g).sum();
                Some(match own {
                    // The stage's own loss may be kept in fp32 under mixed precision.
                    Some(own) if own.dtype() != target.dtype() => {
                        target.cast(own.dtype()) + own * weight
                    }
                    Some(own) => target + own * weight,
                    None => target,
                })
            }
        }
    }
}

/// What crosses between stages: every activation, and so every gradient of one, has this
/// shape and dtype (that of the chunks' parameters under mixed precision).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// `[micro-batch, sequence, hidden]` as the stages send it.
    pub shape: [usize; 3],
    /// The activations' dtype.
    pub dtype: DType,
}

impl Message {
    /// Activations shaped `shape`, of `dtype`.
    pub fn new(shape: [usize; 3], dtype: DType) -> Self {
        Self { shape, dtype }
    }
}

/// What one rank got out of a step.
#[derive(Debug)]
pub struct StepOutput {
    /// Gradients of this rank's chunks, summed over micro-batches (each loss divided by their
    /// number), times the step's loss scale.
    pub grads: GradientsParams,
    /// The mean loss over the micro-batches, on the rank that holds the last stage: the last
    /// stage's loss only (earlier stages' own losses, `StageOutput::ActivationAndLoss`, join
    /// the backward but are not in it).
    pub loss: Option<f64>,
    /// When each action ran, in seconds since the step's origin.
    pub spans: Vec<Span>,
}

/// What one rank got out of a step whose gradients went to a sink.
#[derive(Debug)]
pub struct StepRun {
    /// The mean loss over the micro-batches, on the rank that holds the last stage.
    pub loss: Option<f64>,
    /// When each action ran, in seconds since the step's origin.
    pub spans: Vec<Span>,
}

/// Runs a validated schedule for one pipeline rank.
#[derive(Debug, Clone)]
pub struct PipelineExecutor {
    schedule: Schedule,
    comm: Communicator,
    recompute: bool,
    backward_group: Option<Communicator>,
}

type Inner<B> = <B as AutodiffBackend>::InnerBackend;
type Key = (usize, usize);

/// What a zero-bubble weight half needs: the stage's input (none on the first stage) and the
/// gradient of its output (none on the last).
type WeightHalf<B> = (Option<Tensor<B, 3>>, Option<Tensor<B, 3>>);

/// A forward kept for its backward: the stage's input (a leaf that requires a gradient,
/// except on the first stage) and its output with its graph (none under recompute).
struct Saved<B: Backend, M> {
    input: Option<Tensor<B, 3>>,
    output: Option<StageOutput<B>>,
    /// The module the graph was built with: the chunk with its own parameter leaves.
    module: Option<M>,
}

impl PipelineExecutor {
    /// An executor for `comm`'s rank, which must be the pipeline group (one rank per stage
    /// group of `schedule`).
    pub fn new(schedule: Schedule, comm: Communicator) -> Result<Self, PipelineError> {
        schedule.validate()?;
        if comm.size() != schedule.ranks {
            return Err(PipelineError::Config(format!(
                "the schedule has {} pipeline ranks but the group has {}",
                schedule.ranks,
                comm.size()
            )));
        }
        Ok(Self {
            schedule,
            comm,
            recompute: false,
            backward_group: None,
        })
    }

    /// Makes the ranks of `group` start every backward together; needed when a stage's
    /// backward runs collectives over `group` (tensor parallelism). burn 0.21's autodiff holds a
    /// graph's lock through its backward and ends every backward by locking each graph of the
    /// process in turn, so a rank blocked in a collective inside its next backward would keep a
    /// peer, still finishing the previous one, from ever joining it.
    pub fn with_backward_group(mut self, group: Communicator) -> Self {
        self.backward_group = Some(group);
        self
    }

    /// Waits for the backward group, if any, before a backward.
    fn enter_backward(&self) -> Result<(), PipelineError> {
        match &self.backward_group {
            Some(group) => Ok(group.barrier()?),
            None => Ok(()),
        }
    }

    /// Keep only each stage's input during the step and run its forward again just before its
    /// backward (activation recompute): less memory for one more forward per micro-batch.
    pub fn with_recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }

    /// The schedule this executor replays.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The stages this rank runs, chunk 0 first.
    pub fn stages(&self) -> Vec<usize> {
        let (p, rank) = (self.schedule.ranks, self.comm.rank());
        (0..self.schedule.virtual_stages)
            .map(|chunk| chunk * p + rank)
            .collect()
    }

    /// Runs one step: `chunks[c]` is this rank's chunk `c`, `batches[mb]` micro-batch `mb`,
    /// and every activation (and so every gradient) sent between stages is `message`. The
    /// losses are multiplied by `loss_scale` before their backward (1 without loss scaling);
    /// the reported loss is not. Span times count from `origin`.
    pub fn step<B: AutodiffBackend, M: PipelineStage<B>>(
        &self,
        chunks: &[M],
        batches: &[M::Batch],
        message: Message,
        loss_scale: f64,
        device: &B::Device,
        origin: Instant,
    ) -> Result<StepOutput, M::Error> {
        let mut sink = Accumulate::new(loss_scale);
        let StepRun { loss, spans } =
            self.step_into(chunks, batches, message, device, origin, &mut sink)?;
        Ok(StepOutput {
            grads: sink.grads(),
            loss,
            spans,
        })
    }

    /// [`Self::step`] with the weight gradients handed to `sink` (which also gives the loss
    /// scale), told for each backward whether it is its chunk's last of the step.
    pub fn step_into<B: AutodiffBackend, M: PipelineStage<B>>(
        &self,
        chunks: &[M],
        batches: &[M::Batch],
        message: Message,
        device: &B::Device,
        origin: Instant,
        sink: &mut impl GradientSink<B, M>,
    ) -> Result<StepRun, M::Error> {
        let loss_scale = sink.loss_scale();
        let schedule = &self.schedule;
        let (rank, m) = (self.comm.rank(), schedule.micro_batches);
        if !(loss_scale.is_finite() && loss_scale > 0.0) {
            return Err(PipelineError::Config(format!(
                "the loss scale must be a positive finite number, not {loss_scale}"
            ))
            .into());
        }
        if chunks.len() != schedule.virtual_stages || batches.len() != m {
            return Err(PipelineError::Config(format!(
                "rank {rank} got {} chunk(s) and {} micro-batch(es); the schedule needs {} and {m}",
                chunks.len(),
                batches.len(),
                schedule.virtual_stages
            ))
            .into());
        }
        let last = schedule.stages() - 1;
        let actions = &schedule.actions[rank];
        let halves: HashSet<Key> = actions
            .iter()
            .filter(|a| a.kind == Kind::BackwardInput)
            .map(|a| (a.micro_batch, a.stage))
            .collect();
        let frozen: Vec<M> = if self.recompute || !halves.is_empty() {
            chunks.iter().map(|c| c.clone().no_grad()).collect()
        } else {
            Vec::new()
        };
        let chunk = |stage: usize| &chunks[schedule.chunk_of(stage)];
        let frozen_chunk = |stage: usize| &frozen[schedule.chunk_of(stage)];
        let same_rank = |a: usize, b: usize| schedule.rank_of(a) == schedule.rank_of(b);

        let mut inbox = Inbox::new(schedule, rank);
        let mut inputs: HashMap<Key, Tensor<Inner<B>, 3>> = HashMap::new();
        let mut saved: HashMap<Key, Saved<B, M>> = HashMap::new();
        let mut output_grads: HashMap<Key, Tensor<Inner<B>, 3>> = HashMap::new();
        let mut outgoing: HashMap<(Kind, usize, usize), Tensor<Inner<B>, 3>> = HashMap::new();
        let mut deferred: HashMap<Key, WeightHalf<Inner<B>>> = HashMap::new();
        // The action after which no backward adds to a stage's weight gradients.
        let mut last_weight_action: HashMap<usize, usize> = HashMap::new();
        for (index, action) in actions.iter().enumerate() {
            if matches!(action.kind, Kind::Backward | Kind::BackwardWeight) {
                last_weight_action.insert(action.stage, index);
            }
        }
        let mut loss_sum = 0.0;
        let mut spans = Vec::with_capacity(actions.len());

        let missing = |action: &Action, what: &str| {
            PipelineError::Schedule(format!("rank {rank} reached the {action} without {what}"))
        };
        // The scalar whose backward gives the stage's gradients.
        let target =
            |output: StageOutput<B>, grad: Option<Tensor<Inner<B>, 3>>, action: &Action| {
                output
                    .backward_target(grad.map(Tensor::from_inner), loss_scale / m as f64)
                    .ok_or_else(|| missing(action, "the gradient of its output"))
            };

        for (index, action) in actions.iter().enumerate() {
            let start = origin.elapsed().as_secs_f64();
            let completes_chunk = last_weight_action.get(&action.stage) == Some(&index);
            let key = (action.micro_batch, action.stage);
            let (mb, s) = key;
            match action.kind {
                Kind::RecvForward => {
                    let tensor = inbox.receive(
                        &self.comm,
                        schedule.rank_of(s - 1),
                        (Kind::SendForward, mb, s),
                        message,
                        device,
                    )?;
                    inputs.insert(key, tensor);
                }
                Kind::RecvBackward => {
                    let tensor = inbox.receive(
                        &self.comm,
                        schedule.rank_of(s + 1),
                        (Kind::SendBackward, mb, s),
                        message,
                        device,
                    )?;
                    output_grads.insert(key, tensor);
                }
                Kind::SendForward | Kind::SendBackward => {
                    let tensor = outgoing
                        .remove(&(action.kind, mb, s))
                        .ok_or_else(|| missing(action, "anything to send"))?;
                    let to = if action.kind == Kind::SendForward {
                        s + 1
                    } else {
                        s - 1
                    };
                    self.comm
                        .send(tensor, schedule.rank_of(to))
                        .map_err(PipelineError::from)?;
                }
                Kind::Forward => {
                    let input = if s == 0 {
                        None
                    } else {
                        Some(
                            inputs
                                .remove(&key)
                                .ok_or_else(|| missing(action, "its input"))?,
                        )
                    };
                    let batch = &batches[mb];
                    let (output, kept) = if self.recompute {
                        let output = frozen_chunk(s)
                            .forward(input.clone().map(Tensor::from_inner), batch)?;
                        let kept = Saved {
                            input: input.map(Tensor::from_inner),
                            output: None,
                            module: None,
                        };
                        (output, kept)
                    } else {
                        let leaf = input.map(|x| Tensor::from_inner(x).require_grad());
                        let module = if halves.contains(&key) {
                            frozen_chunk(s).clone()
                        } else {
                            own_leaves(chunk(s).clone())
                        };
                        let output = module.forward(leaf.clone(), batch)?;
                        let kept = Saved {
                            input: leaf,
                            output: Some(output.clone()),
                            module: Some(module),
                        };
                        (output, kept)
                    };
                    match output {
                        StageOutput::Activation(y) | StageOutput::ActivationAndLoss(y, _)
                            if s < last =>
                        {
                            let value = y.inner();
                            if same_rank(s, s + 1) {
                                inputs.insert((mb, s + 1), value);
                            } else {
                                outgoing.insert((Kind::SendForward, mb, s), value);
                            }
                        }
                        StageOutput::Loss(loss) if s == last => {
                            loss_sum += loss.into_scalar().elem::<f64>();
                        }
                        _ => {
                            return Err(PipelineError::Config(format!(
                                "stage {s} of {} returned {}; only the last stage returns the loss",
                                last + 1,
                                if s == last { "activations" } else { "a loss" }
                            ))
                            .into());
                        }
                    }
                    saved.insert(key, kept);
                }
                Kind::Backward | Kind::BackwardInput => {
                    let whole = action.kind == Kind::Backward;
                    let kept = saved
                        .remove(&key)
                        .ok_or_else(|| missing(action, "its forward"))?;
                    let (input, output, module) = match (kept.output, kept.module) {
                        (Some(output), Some(module)) => (kept.input, output, module),
                        _ => {
                            let module = if whole {
                                own_leaves(chunk(s).clone())
                            } else {
                                frozen_chunk(s).clone()
                            };
                            let leaf = kept.input.map(|x| x.detach().require_grad());
                            let output = module.forward(leaf.clone(), &batches[mb])?;
                            (leaf, output, module)
                        }
                    };
                    let grad = if s < last {
                        Some(
                            output_grads
                                .remove(&key)
                                .ok_or_else(|| missing(action, "the gradient of its output"))?,
                        )
                    } else {
                        None
                    };
                    if !whole {
                        let stored = input.as_ref().map(|x| x.clone().inner());
                        deferred.insert(key, (stored, grad.clone()));
                    }
                    // The first stage has no input gradient: its input half has nothing to do.
                    if whole || input.is_some() {
                        let target = target(output, grad, action)?;
                        self.enter_backward()?;
                        let mut grads = if whole {
                            sink.backward(&module, target, completes_chunk)?
                        } else {
                            target.backward()
                        };
                        if let Some(input) = input {
                            let input_grad = input
                                .grad_remove(&mut grads)
                                .ok_or_else(|| missing(action, "a gradient for its input"))?;
                            if same_rank(s - 1, s) {
                                output_grads.insert((mb, s - 1), input_grad);
                            } else {
                                outgoing.insert((Kind::SendBackward, mb, s), input_grad);
                            }
                        }
                    }
                }
                Kind::BackwardWeight => {
                    let (input, grad) = deferred
                        .remove(&key)
                        .ok_or_else(|| missing(action, "its input half"))?;
                    let module = own_leaves(chunk(s).clone());
                    let output = module.forward(input.map(Tensor::from_inner), &batches[mb])?;
                    let target = target(output, grad, action)?;
                    self.enter_backward()?;
                    sink.backward(&module, target, completes_chunk)?;
                }
            }
            spans.push(Span {
                action: *action,
                start,
                end: origin.elapsed().as_secs_f64(),
            });
        }
        let holds_last = self.stages().contains(&last);
        Ok(StepRun {
            loss: holds_last.then(|| loss_sum / m as f64),
            spans,
        })
    }
}

/// `module` with each parameter re-wrapped as a leaf of its own (same ids, same values, no
/// copy), so the graphs of micro-batches in flight share no node. burn 0.21's autodiff loses
/// the graph of a later micro-batch when several in flight share their parameter leaves
/// across backwards (seen with GPipe at 4 ranks: about 4 runs in 10 lost a gradient).
fn own_leaves<B: AutodiffBackend, M: AutodiffModule<B>>(module: M) -> M {
    struct Rewrap;
    impl<B: AutodiffBackend> ModuleMapper<B> for Rewrap {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            param.map(|tensor| {
                let tracked = tensor.is_require_grad();
                let leaf = Tensor::from_inner(tensor.inner());
                if tracked { leaf.require_grad() } else { leaf }
            })
        }
    }
    module.map(&mut Rewrap)
}

/// Messages from each peer, taken in the order the peer sent them: one that arrives before it
/// is wanted waits here, so a receive order that differs from the send order costs memory, not
/// a deadlock.
struct Inbox<B: Backend> {
    /// For each peer, what it sends this rank, in its order: (send kind, micro-batch, stage
    /// that receives).
    expected: HashMap<usize, VecDeque<(Kind, usize, usize)>>,
    early: HashMap<(Kind, usize, usize), Tensor<B, 3>>,
}

impl<B: Backend> Inbox<B> {
    fn new(schedule: &Schedule, rank: usize) -> Self {
        let mut expected: HashMap<usize, VecDeque<_>> = HashMap::new();
        for (peer, actions) in schedule.actions.iter().enumerate() {
            for a in actions {
                let message = match a.kind {
                    Kind::SendForward => (Kind::SendForward, a.micro_batch, a.stage + 1),
                    Kind::SendBackward => (Kind::SendBackward, a.micro_batch, a.stage - 1),
                    _ => continue,
                };
                if schedule.rank_of(message.2) == rank {
                    expected.entry(peer).or_default().push_back(message);
                }
            }
        }
        Self {
            expected,
            early: HashMap::new(),
        }
    }

    fn receive(
        &mut self,
        comm: &Communicator,
        peer: usize,
        want: (Kind, usize, usize),
        message: Message,
        device: &B::Device,
    ) -> Result<Tensor<B, 3>, PipelineError> {
        if let Some(tensor) = self.early.remove(&want) {
            return Ok(tensor);
        }
        loop {
            let next = self
                .expected
                .get_mut(&peer)
                .and_then(VecDeque::pop_front)
                .ok_or_else(|| {
                    PipelineError::Schedule(format!(
                        "rank {} waits for a message that rank {peer} never sends",
                        comm.rank()
                    ))
                })?;
            let tensor: Tensor<B, 3> = comm.recv(peer, message.shape, (device, message.dtype))?;
            if next == want {
                return Ok(tensor);
            }
            self.early.insert(next, tensor);
        }
    }
}
