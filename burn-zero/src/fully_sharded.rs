//! ZeRO stage 3 (the paper's P_os+g+p; PyTorch's FSDP): parameters are sharded too. The model
//! is a chain of units (burn-pipeline's `PipelineStage`: the first reads the batch, the last
//! returns the loss); each rank keeps only its part of every unit. A unit is all-gathered just
//! before its forward and again before its backward, let go after each, and its gradients are
//! reduce-scattered; the next unit's gather runs while the current one computes.
//!
//! A parameter held twice (the same `ParamId`: a head tied to the embedding) is sharded once,
//! with the first unit holding it; a later unit reads its value from that unit's buffer,
//! gathered again for it, and adds its gradient to the first unit's before that is reduced, so
//! the weight gets the gradient of every use, as on one device.
//!
//! burn's tape keeps every tensor a forward used until backward, gathered weights included. So
//! a unit's forward runs untracked, keeping only its input, and its backward runs the forward
//! again with the re-gathered weights (per-unit activation checkpointing, as FSDP is usually
//! run): the price of holding one or two units whole instead of the model (three while a unit
//! that reads a tied weight runs: the unit holding that weight is gathered for it too).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Shape, Tensor, TensorData};
use burn_comm::{Communicator, Work};
use burn_ddp::MissingGradient;
use burn_ddp::params;
use burn_pipeline::{PipelineError, PipelineStage, StageOutput};

use crate::ZeroError;
use crate::clip::clip_global_norm;
use crate::flat::{FlatLayout, compact};
use crate::memory::ModelStateBytes;
use crate::optimizer::{PlacedAdamW, bytes, to_f32};
use crate::precision::{LossScaler, StepOutcome, cast};
use crate::sharded::{ZeroConfig, unscale};
use crate::state::{self, LossScaleState, ParamRange, ShardState, StateTensor};
use burn::optim::AdamWConfig;
use burn_ddp::reducer::Reduction;

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// A chain of units whose parameters, gradients and optimizer state are all sharded over a
/// data-parallel group.
///
/// ```ignore
/// let mut fsdp = FullyShardedDataParallel::new(units, comm, &adamw, ZeroConfig::new())?;
/// for micro_batch in &batches {
///     let loss = fsdp.forward_backward(micro_batch, 1.0 / batches.len() as f64)?;
/// }
/// fsdp.step(lr)?;
/// let whole = fsdp.full()?; // every unit gathered, for export
/// ```
pub struct FullyShardedDataParallel<B: AutodiffBackend, S: PipelineStage<B>> {
    /// The units with every parameter emptied: ids and structure only.
    skeletons: Vec<S>,
    /// Where each unit's parameters, in visiting order, come from.
    sources: Vec<Vec<Source>>,
    /// Shape of every parameter, by index.
    shapes: Vec<Vec<usize>>,
    /// Name of every parameter (in its unit), by index.
    names: Vec<String>,
    layout: FlatLayout,
    comm: Communicator,
    config: ZeroConfig,
    backward_group: Option<Communicator>,
    /// This rank's part of each unit, in the compute dtype: for fp32 parameters also the master
    /// weights, which the optimizer holds under mixed precision.
    shard: Vec<Tensor<Inner<B>, 1>>,
    optimizer: PlacedAdamW<Inner<B>>,
    scaler: Option<LossScaler>,
    /// The ranks that agree on skipping a step for overflow, when more than the group.
    overflow_group: Option<Communicator>,
    /// This rank's part of each unit's gradient, summed over the step's micro-batches.
    grads: Option<Vec<Tensor<Inner<B>, 1>>>,
    memory: ModelStateBytes,
    grad_norm: Option<f64>,
}

/// Where a unit's parameter comes from.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// Parameter `p` of the layout, in this unit's buffer.
    Own(usize),
    /// Parameter `p` of the layout, held by the earlier unit `owner` (a tied weight).
    Tied { p: usize, owner: usize },
}

impl Source {
    /// The parameter's index in the layout.
    fn param(self) -> usize {
        match self {
            Self::Own(p) | Self::Tied { p, .. } => p,
        }
    }
}

impl<B: AutodiffBackend, S: PipelineStage<B>> FullyShardedDataParallel<B, S>
where
    S::Error: From<ZeroError>,
{
    /// Shards `units` (whole on every rank; rank 0's values are used) over `comm`, one flat
    /// buffer per unit; `optimizer` is the AdamW each rank applies to its shard. A parameter
    /// found again in a later unit (same id) is sharded with the first unit only. The units are
    /// taken one at a time and each let go once this rank's shard of it is kept, so built
    /// lazily they are never all whole at once.
    pub fn new(
        units: impl IntoIterator<Item = S>,
        comm: Communicator,
        optimizer: &AdamWConfig,
        config: ZeroConfig,
    ) -> Result<Self, ZeroError> {
        config.check()?;
        let param_dtype = config.precision.as_ref().map(|p| p.param_dtype);
        let (rank, world) = (comm.rank(), comm.size());
        let (mut names, mut shapes, mut numels, mut dtypes) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut members, mut sources, mut shard, mut skeletons) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut seen: HashMap<ParamId, (usize, usize)> = HashMap::new();
        for (u, unit) in units.into_iter().enumerate() {
            let (mut member, mut source, mut values) = (Vec::new(), Vec::new(), Vec::new());
            for slot in params::slots::<B, S>(&unit) {
                let shape = slot.shape.clone();
                if !slot.require_grad {
                    return Err(ZeroError::Config(format!(
                        "`{}` is frozen; ZeRO-3 shards trainable parameters only, so keep frozen ones out of its units",
                        slot.name
                    )));
                }
                if let Some(&(p, owner)) = seen.get(&slot.id) {
                    if shapes[p] != shape {
                        return Err(ZeroError::Config(format!(
                            "`{}` of unit {u} has the id of `{}` of unit {owner} but the shape {shape:?}, not {:?}; a tied weight is the same tensor in every unit",
                            slot.name, names[p], shapes[p]
                        )));
                    }
                    source.push(Source::Tied { p, owner });
                    continue;
                }
                let p = names.len();
                seen.insert(slot.id, (p, u));
                source.push(Source::Own(p));
                member.push(p);
                names.push(slot.name.clone());
                shapes.push(shape);
                numels.push(slot.numel);
                dtypes.push(param_dtype.unwrap_or(slot.dtype));
                values.push(comm.broadcast(slot.value.clone(), 0)?);
            }
            if member.is_empty() {
                return Err(ZeroError::Config(format!(
                    "unit {u} has no float parameters of its own; merge it into a neighbour"
                )));
            }
            // This unit alone, laid out as it is in the whole layout, gives this rank's part.
            let first = member[0];
            let alone = FlatLayout::new(
                &numels[first..],
                &dtypes[first..],
                vec![(0..member.len()).collect()],
                world,
            )?;
            shard.push(compact(alone.shard_of(0, rank, &values)));
            members.push(member);
            sources.push(source);
            skeletons.push(empty(unit));
        }
        if skeletons.is_empty() {
            return Err(ZeroError::Config("the model has no units to shard".into()));
        }
        let layout = FlatLayout::new(&numels, &dtypes, members, world)?;
        // The master weights start from the parameters as given, before their rounding.
        let master = param_dtype.map(|_| shard.iter().cloned().map(to_f32).collect());
        let shard = shard
            .into_iter()
            .zip(&layout.units)
            .map(|(part, unit)| cast(part, unit.dtype))
            .collect();
        let optimizer = PlacedAdamW::new(optimizer, config.offload, layout.units.len(), master)?;
        let scaler = config.loss_scaler();
        Ok(Self {
            skeletons,
            sources,
            shapes,
            names,
            layout,
            comm,
            config,
            backward_group: None,
            shard,
            optimizer,
            scaler,
            overflow_group: None,
            grads: None,
            memory: ModelStateBytes::default(),
            grad_norm: None,
        })
    }

    /// Makes the ranks of `group` start every unit's backward together: needed when a unit's
    /// backward runs collectives over `group` (tensor parallelism), for the reason given at
    /// burn-pipeline's `PipelineExecutor::with_backward_group`.
    pub fn with_backward_group(mut self, group: Communicator) -> Self {
        self.backward_group = Some(group);
        self
    }

    /// Agrees on overflow (f16 loss scaling) over `group`, which holds this engine's group:
    /// the whole job when other ranks hold other parts of the model (tensor parallelism), so
    /// they all skip the same steps; see `ShardedDataParallel::with_overflow_group`.
    pub fn with_overflow_group(mut self, group: Communicator) -> Self {
        self.overflow_group = Some(group);
        self
    }

    /// How the parameters are packed and sharded.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The loss scale the next backward multiplies by (f16 with loss scaling), if any.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(LossScaler::scale)
    }

    /// The global L2 norm of the gradient at the last applied step, before clipping; only
    /// computed under [`ZeroConfig::max_grad_norm`].
    pub fn grad_norm(&self) -> Option<f64> {
        self.grad_norm
    }

    /// Model-state bytes this rank held in its last step: its parameter shard, the gradient
    /// shard going into the step, and the optimizer state after it.
    pub fn memory(&self) -> ModelStateBytes {
        self.memory
    }

    /// Forward and backward of one micro-batch through every unit; the loss is multiplied by
    /// `scale` before backward (`1 / micro-batches` for gradient accumulation), and by the loss
    /// scale under f16. The gradients are reduce-scattered unit by unit and added to this
    /// step's. Returns the loss, unscaled.
    pub fn forward_backward(&mut self, batch: &S::Batch, scale: f64) -> Result<f64, S::Error> {
        let last = self.skeletons.len() - 1;
        let mut gathers = Gathers::new(self, 0);
        let owner = |o: usize| Ok(self.comm.all_gather(self.shard[o].clone(), 0)?);
        // Gradients of tied weights from later units, until their own unit's backward.
        let mut tied = HashMap::new();
        // Forward, untracked, keeping each unit's input.
        let mut inputs: Vec<Option<Tensor<Inner<B>, 3>>> = Vec::with_capacity(last);
        let mut x: Option<Tensor<B, 3>> = None;
        for u in 0..last {
            let module = self.fill(u, gathers.take(self, u, Some(u + 1))?, &owner, false)?;
            inputs.push(x.as_ref().map(|t| t.clone().inner()));
            x = Some(activation(module.forward(x, batch)?, u, last)?);
        }
        // The last unit stays gathered from its forward to its backward.
        let full = gathers.take(self, last, last.checked_sub(1))?;
        let module = self.fill(last, full, &owner, true)?;
        let leaf = x.map(|t| Tensor::from_inner(t.inner()).require_grad());
        let loss = match module.forward(leaf.clone(), batch)? {
            StageOutput::Loss(loss) => loss,
            _ => return Err(order_error(last, last).into()),
        };
        let value = loss.clone().into_scalar().elem::<f64>();
        let mut pending = Vec::with_capacity(last + 1);
        let scale = scale * self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let mut grad = self.backward(last, module, leaf, loss * scale, &mut tied, &mut pending)?;
        for u in (0..last).rev() {
            let full = gathers.take(self, u, u.checked_sub(1))?;
            let module = self.fill(u, full, &owner, true)?;
            let leaf = inputs[u]
                .take()
                .map(|t| Tensor::from_inner(t).require_grad());
            let output = module.forward(leaf.clone(), batch)?;
            let output_grad = grad
                .take()
                .expect("every unit after the first has an input");
            // The unit's own loss (a mixture of experts' balancing losses) is weighted as the
            // last unit's.
            let target = output
                .backward_target(Some(Tensor::from_inner(output_grad)), scale)
                .ok_or_else(|| order_error(u, last))?;
            grad = self.backward(u, module, leaf, target, &mut tied, &mut pending)?;
        }
        debug_assert!(tied.is_empty(), "every tied gradient reached its unit");
        let mut sums = self.grads.take().unwrap_or_default();
        let first = sums.is_empty();
        for (u, work) in pending {
            let part = work.wait().map_err(ZeroError::from)?;
            if first {
                sums.push(part);
            } else {
                sums[u] = sums[u].clone() + part;
            }
        }
        if first {
            sums.reverse();
        }
        self.grads = Some(sums);
        Ok(value)
    }

    /// Backward of `target` through unit `u`'s `module`; starts the reduce-scatter of its
    /// gradients and returns the gradient of its input. The gradients of weights tied to an
    /// earlier unit wait in `tied` for that unit's, which they are added to; a weight used twice
    /// in this unit gets both gradients.
    fn backward(
        &self,
        u: usize,
        module: S,
        input: Option<Tensor<B, 3>>,
        target: Tensor<B, 1>,
        tied: &mut HashMap<usize, Tensor<Inner<B>, 1>>,
        pending: &mut Vec<(usize, Work<Tensor<Inner<B>, 1>>)>,
    ) -> Result<Option<Tensor<Inner<B>, 3>>, ZeroError> {
        if let Some(group) = &self.backward_group {
            group.barrier()?;
        }
        let mut grads = target.backward();
        let unit = &self.layout.units[u];
        let mut parts = Vec::with_capacity(unit.params.len());
        // Where each of this unit's own parameters is in `parts`, for a second use of it here.
        let mut position = HashMap::new();
        for (slot, &source) in params::slots::<B, S>(&module).iter().zip(&self.sources[u]) {
            let p = source.param();
            let grad = (slot.take)(&mut grads).ok_or_else(|| {
                ZeroError::MissingGradients(vec![MissingGradient {
                    name: slot.name.clone(),
                    ranks: vec![self.comm.rank()],
                }])
            })?;
            let grad = match tied.remove(&p) {
                Some(later) => grad + later,
                None => grad,
            };
            match source {
                Source::Own(_) => {
                    position.insert(p, parts.len());
                    parts.push(grad);
                }
                Source::Tied { owner, .. } if owner == u => {
                    let at = position[&p];
                    parts[at] = parts[at].clone() + grad;
                }
                Source::Tied { .. } => {
                    tied.insert(p, grad);
                }
            }
        }
        let flat = self.layout.flatten(u, parts);
        let reduce_dtype = self.config.reduce_dtype();
        pending.push((u, Reduction::Part.start(&self.comm, flat, reduce_dtype)));
        Ok(input.map(|x| {
            x.grad_remove(&mut grads)
                .expect("a unit's input that requires a gradient gets one")
        }))
    }

    /// Steps this rank's shard with the gradients of the micro-batches since the last step;
    /// under loss scaling, a step whose gradients overflowed on some rank is skipped on every
    /// rank.
    pub fn step(&mut self, lr: f64) -> Result<StepOutcome, ZeroError> {
        let grads = self.grads.take().ok_or_else(|| {
            ZeroError::Config(
                "step without a forward_backward since the last one; run one first".into(),
            )
        })?;
        let grad_bytes = grads.iter().map(bytes).sum();
        let grads = grads.into_iter().map(to_f32).collect();
        let agree = self.overflow_group.as_ref().unwrap_or(&self.comm);
        let grads = match unscale(agree, self.scaler.as_mut(), grads)? {
            Ok(grads) => grads,
            Err(skipped) => return Ok(skipped),
        };
        let (grads, norm) = clip_global_norm(&self.comm, grads, self.config.max_grad_norm)?;
        self.grad_norm = norm;
        let shard = std::mem::take(&mut self.shard);
        let updated = self
            .optimizer
            .step(lr, grads, || shard.into_iter().map(to_f32).collect());
        self.shard = updated
            .into_iter()
            .zip(&self.layout.units)
            .map(|(part, unit)| part.cast(unit.dtype))
            .collect();
        self.memory = ModelStateBytes {
            params: self.shard.iter().map(bytes).sum(),
            grads: grad_bytes,
            optimizer: self.optimizer.state_bytes().0,
            host: self.optimizer.state_bytes().1,
        };
        Ok(StepOutcome::Applied)
    }

    /// This rank's ranges of the parameters (named within their units), in its shard's
    /// order: what [`shard_state`](Self::shard_state) gives and
    /// [`restore_state`](Self::restore_state) takes.
    pub fn shard_ranges(&self) -> Vec<ParamRange> {
        state::ranges(&self.layout, &self.names, &self.shapes, self.comm.rank())
    }

    /// The unit holding each of [`shard_ranges`](Self::shard_ranges), in order.
    pub fn shard_range_units(&self) -> Vec<usize> {
        let rank = self.comm.rank();
        (0..self.layout.units.len())
            .flat_map(|u| self.layout.pieces(u, rank).into_iter().map(move |_| u))
            .collect()
    }

    /// This rank's part of the training state, for a checkpoint, in host memory.
    pub fn shard_state(&self) -> ShardState {
        self.shard_tensors().into_host()
    }

    /// This rank's part of the training state as tensors, which the next step leaves as they
    /// are (a burn tensor is a value): views of the engine's buffers, not copies, where the
    /// engine holds them (an offloaded optimizer's moments and master weights in host memory).
    pub fn shard_tensors(&self) -> ShardState<StateTensor<Inner<B>>> {
        let rank = self.comm.rank();
        let parts = self.optimizer.held_master().unwrap_or_else(|| {
            let f32 = |t: &Tensor<Inner<B>, 1>| StateTensor::Device(to_f32(t.clone()));
            self.shard.iter().map(f32).collect()
        });
        let weights = state::cut(&self.layout, rank, parts);
        state::shard_state(
            &self.layout,
            rank,
            self.shard_ranges(),
            weights,
            &self.optimizer,
            self.scaler.as_ref(),
        )
    }

    /// Continues from a checkpoint's state: the moments and step count (in
    /// [`shard_ranges`](Self::shard_ranges)' order) and the loss scaler. The weights come with
    /// the units this engine was built from.
    pub fn restore_state(
        &mut self,
        moments: Option<&[Vec<TensorData>; 2]>,
        steps: usize,
        loss_scale: Option<LossScaleState>,
    ) -> Result<(), ZeroError> {
        let device = self.shard[0].device();
        let rank = self.comm.rank();
        let (layout, optimizer) = (&self.layout, &mut self.optimizer);
        let scaler = self.scaler.as_mut();
        state::restore(
            layout, rank, optimizer, scaler, moments, steps, loss_scale, &device,
        )
    }

    /// Every unit gathered whole, its parameters trainable: for evaluation and export.
    pub fn full(&self) -> Result<Vec<S>, ZeroError> {
        self.gather_all(self.shard.clone())
    }

    /// Every unit gathered whole from the fp32 master weights, for export; without mixed
    /// precision, [`full`](Self::full).
    pub fn full_master(&self) -> Result<Vec<S>, ZeroError> {
        match self.master() {
            Some(master) => self.gather_all(master),
            None => self.full(),
        }
    }

    /// This rank's parts of the fp32 master weights, on the shard's device, when held.
    fn master(&self) -> Option<Vec<Tensor<Inner<B>, 1>>> {
        let device = self.shard.first()?.device();
        self.optimizer.master(&device)
    }

    /// [`full_master`](Self::full_master) at the end of training: the optimizer's state and
    /// the shards are let go before the units are gathered, so the whole model is never held
    /// beside them (AdamW's two moments alone are twice the shard).
    pub fn into_full_master(mut self) -> Result<Vec<S>, ZeroError> {
        let master = self.master();
        // An optimizer of no parts holds nothing: the moments (and masters, held in `master`
        // now when there are any) go with the one it replaces.
        drop(std::mem::replace(
            &mut self.optimizer,
            PlacedAdamW::Device(Vec::new()),
        ));
        self.grads = None;
        let parts = match master {
            Some(master) => {
                self.shard.clear();
                master
            }
            None => std::mem::take(&mut self.shard),
        };
        self.gather_all(parts)
    }

    fn gather_all(&self, parts: Vec<Tensor<Inner<B>, 1>>) -> Result<Vec<S>, ZeroError> {
        let full = parts
            .into_iter()
            .map(|part| self.comm.all_gather(part, 0))
            .collect::<Result<Vec<_>, _>>()?;
        let owner = |o: usize| Ok(full[o].clone());
        (0..full.len())
            .map(|u| self.fill(u, full[u].clone(), &owner, true))
            .collect()
    }

    /// Unit `u` with its parameters from `full`, its gathered buffer, and its tied weights
    /// from `owner(o)`, the gathered buffer of the unit `o` holding them; `tracked` makes them
    /// leaves that get gradients.
    fn fill(
        &self,
        u: usize,
        full: Tensor<Inner<B>, 1>,
        owner: &dyn Fn(usize) -> Result<Tensor<Inner<B>, 1>, ZeroError>,
        tracked: bool,
    ) -> Result<S, ZeroError> {
        let own = self.layout.unflatten(u, full);
        let mut owners: HashMap<usize, Vec<Tensor<Inner<B>, 1>>> = HashMap::new();
        let mut values = Vec::with_capacity(self.sources[u].len());
        let mut shapes = Vec::with_capacity(self.sources[u].len());
        let mut next_own = 0;
        for &source in &self.sources[u] {
            let value = match source {
                Source::Own(_) => {
                    next_own += 1;
                    own[next_own - 1].clone()
                }
                Source::Tied { p, owner: o } if o == u => {
                    let at = self.layout.units[u].params.iter().position(|&q| q == p);
                    own[at.expect("a weight used twice is in its unit")].clone()
                }
                Source::Tied { p, owner: o } => {
                    let values = match owners.entry(o) {
                        Entry::Occupied(held) => held.into_mut(),
                        Entry::Vacant(slot) => slot.insert(self.layout.unflatten(o, owner(o)?)),
                    };
                    let at = self.layout.units[o].params.iter().position(|&q| q == p);
                    values[at.expect("a tied weight is in its owner's unit")].clone()
                }
            };
            values.push(value);
            shapes.push(self.shapes[source.param()].clone());
        }
        Ok(self.skeletons[u].clone().map(&mut Filler::<B> {
            values: values.into_iter(),
            shapes: shapes.into_iter(),
            tracked,
        }))
    }
}

/// The all-gathers of a micro-batch: the one the next unit needs is started before the current
/// one computes (with prefetch on).
struct Gathers<B: burn::tensor::backend::Backend> {
    next: Option<(usize, Work<Tensor<B, 1>>)>,
}

impl<B: burn::tensor::backend::Backend> Gathers<B> {
    fn new<A: AutodiffBackend<InnerBackend = B>, S: PipelineStage<A>>(
        fsdp: &FullyShardedDataParallel<A, S>,
        first: usize,
    ) -> Self
    where
        S::Error: From<ZeroError>,
    {
        Self {
            next: Some((
                first,
                fsdp.comm.all_gather_async(fsdp.shard[first].clone(), 0),
            )),
        }
    }

    /// Unit `u` whole; starts the gather of `then` first when prefetching.
    fn take<A: AutodiffBackend<InnerBackend = B>, S: PipelineStage<A>>(
        &mut self,
        fsdp: &FullyShardedDataParallel<A, S>,
        u: usize,
        then: Option<usize>,
    ) -> Result<Tensor<B, 1>, ZeroError>
    where
        S::Error: From<ZeroError>,
    {
        let start = |v: usize| (v, fsdp.comm.all_gather_async(fsdp.shard[v].clone(), 0));
        let current = match self.next.take() {
            Some((v, work)) if v == u => work,
            _ => start(u).1,
        };
        if fsdp.config.prefetch {
            self.next = then.map(start);
            Ok(current.wait()?)
        } else {
            let full = current.wait()?;
            self.next = then.map(start);
            Ok(full)
        }
    }
}

/// The activations of unit `u`, which is not the last (its own loss, if any, joins its
/// backward, when the forward is done again).
fn activation<B: AutodiffBackend>(
    output: StageOutput<B>,
    u: usize,
    last: usize,
) -> Result<Tensor<B, 3>, ZeroError> {
    output
        .into_activation()
        .map(|(y, _)| y)
        .ok_or_else(|| order_error(u, last))
}

fn order_error(u: usize, last: usize) -> ZeroError {
    ZeroError::Stage(PipelineError::Config(format!(
        "unit {u} of {} returned {}; only the last unit returns the loss",
        last + 1,
        if u == last { "activations" } else { "a loss" }
    )))
}

/// `module` with every float parameter replaced by an empty tensor (same id): its structure
/// without its weights.
fn empty<B: AutodiffBackend, M: AutodiffModule<B>>(module: M) -> M {
    struct Empty;
    impl<B: AutodiffBackend> ModuleMapper<B> for Empty {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            param
                .map(|tensor| Tensor::empty(Shape::new([0; D]), (&tensor.device(), tensor.dtype())))
        }
    }
    module.map(&mut Empty)
}

/// Fills an emptied module's float parameters, in visiting order.
struct Filler<B: AutodiffBackend> {
    values: std::vec::IntoIter<Tensor<Inner<B>, 1>>,
    shapes: std::vec::IntoIter<Vec<usize>>,
    tracked: bool,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Filler<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let flat = self.values.next().expect("a value per parameter");
        let shape: [usize; D] = self
            .shapes
            .next()
            .expect("a shape per parameter")
            .try_into()
            .expect("the shape has the parameter's rank");
        let tracked = self.tracked;
        param.map(|_| {
            let value = Tensor::from_inner(flat.reshape(shape));
            if tracked { value.require_grad() } else { value }
        })
    }
}
