//! ZeRO stages 1 and 2 (Rajbhandari et al., 2020): every rank holds the whole model for its
//! forward and backward, but only its shard of the optimizer state. Stage 1 averages whole
//! gradients and each rank uses its part; stage 2 reduce-scatters them so each rank keeps only
//! its part. Each rank steps its shard and the updated shards are all-gathered into every
//! replica.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};
use burn_comm::Communicator;
use burn_ddp::BackwardHooks;
use burn_ddp::params::{self, ParamSlot};
use burn_ddp::reducer::{Buckets, Reducer, Reduction};

use crate::ZeroError;
use crate::clip::clip_global_norm;
use crate::flat::{FlatLayout, compact};
use crate::memory::{ModelStateBytes, ZeroStage};
use crate::optimizer::{PlacedAdamW, bytes, to_f32};
use crate::precision::{LossScaler, MixedPrecision, StepOutcome, cast, overflowed};
use crate::state::{self, LossScaleState, ParamRange, ShardState, StateTensor};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;
/// One reduced gradient per unit: the whole buffer or this rank's part.
type UnitGrads<B> = Vec<Tensor<Inner<B>, 1>>;

/// Settings shared by the ZeRO engines.
#[derive(Config, Debug)]
pub struct ZeroConfig {
    /// Gradients per reduction under stages 1 and 2, in bytes: each such bucket is one flat
    /// unit, sharded over the group.
    #[config(default = 26214400)]
    pub bucket_cap_bytes: usize,
    /// Start each unit's reduction during backward (stages 1 and 2). Off: all after backward.
    #[config(default = true)]
    pub overlap: bool,
    /// Gather the next unit's parameters while the current one computes (stage 3).
    #[config(default = true)]
    pub prefetch: bool,
    /// Keep the optimizer state in host memory and step it there (ZeRO-Offload): for models
    /// on a GPU whose memory the state would not fit.
    #[config(default = false)]
    pub offload: bool,
    /// Parameters and gradients in 16 bits, fp32 master weights in the optimizer's shard
    /// (none: everything in the parameters' own dtype).
    #[config(default = "None")]
    pub precision: Option<MixedPrecision>,
    /// Clip the whole gradient to this global L2 norm before each step (DeepSpeed's
    /// `gradient_clipping`; 1.0 is usual for Llama-style training). None: no clipping.
    #[config(default = "None")]
    pub max_grad_norm: Option<f64>,
}

impl ZeroConfig {
    /// Checks the settings every engine shares.
    pub(crate) fn check(&self) -> Result<(), ZeroError> {
        if self.bucket_cap_bytes == 0 {
            return Err(ZeroError::Config(
                "bucket_cap_bytes is 0; give buckets at least one byte (25 MiB is usual)".into(),
            ));
        }
        if let Some(precision) = &self.precision {
            precision.check()?;
        }
        if let Some(max) = self.max_grad_norm
            && !(max.is_finite() && max > 0.0)
        {
            return Err(ZeroError::Config(format!(
                "max_grad_norm is {max}; clip to a positive finite norm (1.0 is usual), or give none"
            )));
        }
        Ok(())
    }

    /// The dynamic loss scale's starting state, under f16 loss scaling.
    pub(crate) fn loss_scaler(&self) -> Option<LossScaler> {
        let precision = self.precision.as_ref()?;
        precision.loss_scale.clone().map(LossScaler::new)
    }

    /// The dtype gradients are reduced in, if not their own.
    pub(crate) fn reduce_dtype(&self) -> Option<DType> {
        self.precision.as_ref().map(MixedPrecision::reduce_dtype)
    }
}

/// Where the last step's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ZeroStepStats {
    /// Waiting for gradient reductions after backward: the part not overlapped.
    pub comm_wait: Duration,
    /// Units whose reduction started while backward was still running.
    pub overlapped_units: usize,
}

/// A model replica whose optimizer state (stage 1), and gradients (stage 2), are sharded over a
/// data-parallel group.
///
/// ```ignore
/// let mut zero = ShardedDataParallel::new(model, comm, ZeroStage::Gradients, &adamw, ZeroConfig::new())?;
/// for micro_batch in batches {
///     let loss = zero.module().loss(micro_batch);
///     zero.backward(loss)?; // reduced at once, accumulated over micro-batches
/// }
/// zero.step(lr)?;
/// ```
pub struct ShardedDataParallel<B: BackwardHooks, M: AutodiffModule<B>> {
    module: Option<M>,
    comm: Communicator,
    stage: ZeroStage,
    config: ZeroConfig,
    names: Vec<String>,
    layout: Arc<FlatLayout>,
    /// The units as the gradient reducer's buckets.
    buckets: Arc<Buckets>,
    optimizer: PlacedAdamW<Inner<B>>,
    scaler: Option<LossScaler>,
    /// The ranks that agree on skipping a step for overflow, when more than the data-parallel
    /// group: every rank holding a part of the model (tensor and pipeline parallelism).
    overflow_group: Option<Communicator>,
    /// Parameters whose gradient got a part after it was taken: taken after backward from then
    /// on, as DDP does.
    late: Vec<bool>,
    /// Reduced gradients summed over this step's backwards, per unit: the whole buffer (stage
    /// 1) or this rank's part (stage 2).
    grads: Option<UnitGrads<B>>,
    memory: ModelStateBytes,
    stats: ZeroStepStats,
    grad_norm: Option<f64>,
}

impl<B: BackwardHooks, M: AutodiffModule<B>> ShardedDataParallel<B, M> {
    /// Wraps `module` at `stage` (1 or 2), replacing its parameters by rank 0's so every
    /// replica starts equal; `optimizer` is the AdamW every rank applies to its shard.
    pub fn new(
        module: M,
        comm: Communicator,
        stage: ZeroStage,
        optimizer: &AdamWConfig,
        config: ZeroConfig,
    ) -> Result<Self, ZeroError> {
        if !matches!(stage, ZeroStage::OptimizerState | ZeroStage::Gradients) {
            return Err(ZeroError::Config(format!(
                "ShardedDataParallel runs ZeRO stages 1 and 2, not {stage}; use FullyShardedDataParallel for stage 3 and burn-ddp for stage 0"
            )));
        }
        config.check()?;
        let all = params::slots::<B, M>(&module);
        let mut values = Vec::with_capacity(all.len());
        let mut trainable = Vec::new();
        for slot in &all {
            let value = comm.broadcast(slot.value.clone(), 0)?;
            if slot.require_grad {
                trainable.push(value.clone());
            }
            values.push(match &config.precision {
                Some(p) => cast(value, p.param_dtype),
                None => value,
            });
        }
        let module = params::load::<B, M>(module, values);
        let slots = params::trainable::<B, M>(&module);
        if slots.is_empty() {
            return Err(ZeroError::Config(
                "the module has no trainable float parameters; there is nothing to shard".into(),
            ));
        }
        // Backward reaches the last parameters first.
        let order: Vec<usize> = (0..slots.len()).rev().collect();
        let numels: Vec<usize> = slots.iter().map(|s| s.numel).collect();
        let dtypes: Vec<_> = slots.iter().map(|s| s.dtype).collect();
        let layout = FlatLayout::bucketed(
            &numels,
            &dtypes,
            &order,
            config.bucket_cap_bytes,
            comm.size(),
        )?;
        // The master weights start from the parameters as given, before their rounding.
        let master = config.precision.as_ref().map(|_| {
            (0..layout.units.len())
                .map(|u| compact(to_f32(layout.shard_of(u, comm.rank(), &trainable))))
                .collect()
        });
        drop(trainable);
        let parts = layout.units.len();
        let optimizer = PlacedAdamW::new(optimizer, config.offload, parts, master)?;
        let scaler = config.loss_scaler();
        Ok(Self {
            module: Some(module),
            scaler,
            overflow_group: None,
            late: vec![false; slots.len()],
            names: slots.iter().map(|s| s.name.clone()).collect(),
            comm,
            stage,
            config,
            buckets: Arc::new(layout.buckets()),
            layout: Arc::new(layout),
            optimizer,
            grads: None,
            memory: ModelStateBytes::default(),
            stats: ZeroStepStats::default(),
            grad_norm: None,
        })
    }

    /// Agrees on overflow (f16 loss scaling) over `group` rather than the data-parallel group
    /// alone: give the whole job when other ranks hold other parts of the model (tensor- or
    /// pipeline-parallel), so that they all skip the same steps and keep one loss scale, as
    /// Megatron agrees on `found_inf` over its model-parallel group. `group` must hold the
    /// data-parallel group's ranks.
    pub fn with_overflow_group(mut self, group: Communicator) -> Self {
        self.overflow_group = Some(group);
        self
    }

    /// This rank's ranges of the parameters, in its shard's order: what
    /// [`shard_state`](Self::shard_state) gives and [`restore_state`](Self::restore_state)
    /// takes.
    pub fn shard_ranges(&self) -> Vec<ParamRange> {
        let shapes: Vec<Vec<usize>> = params::trainable::<B, M>(self.module())
            .into_iter()
            .map(|slot| slot.shape)
            .collect();
        state::ranges(&self.layout, &self.names, &shapes, self.comm.rank())
    }

    /// This rank's part of the training state, for a checkpoint, in host memory.
    pub fn shard_state(&self) -> ShardState {
        self.shard_tensors().into_host()
    }

    /// This rank's part of the training state as tensors, which the next step leaves as they
    /// are (a burn tensor is a value). The moments and master weights are views of the
    /// engine's buffers, not copies, where the engine holds them (host memory when offloaded);
    /// fp32 weights without a master copy are copied to host memory, as a view would keep
    /// every rank's part alive.
    pub fn shard_tensors(&self) -> ShardState<StateTensor<Inner<B>>> {
        let slots = params::trainable::<B, M>(self.module());
        let rank = self.comm.rank();
        let weights = match self.optimizer.held_master() {
            Some(master) => state::cut(&self.layout, rank, master),
            None => {
                let values: Vec<_> = slots.iter().map(|s| to_f32(s.value.clone())).collect();
                state::cut_params(&self.layout, rank, &values)
            }
        };
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
    /// the module this engine was built from.
    pub fn restore_state(
        &mut self,
        moments: Option<&[Vec<TensorData>; 2]>,
        steps: usize,
        loss_scale: Option<LossScaleState>,
    ) -> Result<(), ZeroError> {
        let device = params::trainable::<B, M>(self.module())[0].device.clone();
        let rank = self.comm.rank();
        let (layout, optimizer) = (&self.layout, &mut self.optimizer);
        let scaler = self.scaler.as_mut();
        state::restore(
            layout, rank, optimizer, scaler, moments, steps, loss_scale, &device,
        )
    }

    /// The local replica, for the forward pass.
    pub fn module(&self) -> &M {
        self.module
            .as_ref()
            .expect("the module is back after every step")
    }

    /// Unwraps the replica.
    pub fn into_module(self) -> M {
        self.module.expect("the module is back after every step")
    }

    /// The data-parallel group.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// How the parameters are packed and sharded.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Model-state bytes this rank held in its last step: parameters, the gradients going into
    /// the step, and the optimizer state after it.
    pub fn memory(&self) -> ModelStateBytes {
        self.memory
    }

    /// The loss scale the next backward multiplies by (f16 with loss scaling), if any.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(LossScaler::scale)
    }

    /// Timings of the last backward.
    pub fn stats(&self) -> ZeroStepStats {
        self.stats
    }

    /// The global L2 norm of the gradient at the last applied step, before clipping; only
    /// computed under [`ZeroConfig::max_grad_norm`].
    pub fn grad_norm(&self) -> Option<f64> {
        self.grad_norm
    }

    /// Backward of `loss` (times the loss scale, under f16), its gradients reduced over the
    /// group at once (overlapping backward when [`ZeroConfig::overlap`] is on) and added to
    /// this step's.
    pub fn backward(&mut self, loss: Tensor<B, 1>) -> Result<(), ZeroError> {
        if !B::is_tracked(&loss) {
            return Err(ZeroError::Config(
                "the loss does not depend on any parameter that requires a gradient; compute it from the module's forward".into(),
            ));
        }
        let reducer = self.reducer()?;
        let loss = match &self.scaler {
            Some(scaler) => loss * scaler.scale(),
            None => loss,
        };
        let (reduced, late, stats) = reduce(loss, reducer, self.config.overlap)?;
        self.stats = stats;
        self.add(reduced, late);
        Ok(())
    }

    /// Adds gradients of the replica computed outside the engine (a pipeline's, summed over
    /// its micro-batches) to this step's, reduced over the group now that they are complete.
    /// `loss_scale` is what the loss was multiplied by before their backward: it must be this
    /// engine's [`loss_scale`](Self::loss_scale), or 1 without loss scaling.
    pub fn add_gradients(
        &mut self,
        mut grads: GradientsParams,
        loss_scale: f64,
    ) -> Result<(), ZeroError> {
        let expected = self.loss_scale().unwrap_or(1.0);
        if loss_scale != expected {
            return Err(ZeroError::Config(format!(
                "the gradients were computed at loss scale {loss_scale} but the engine's is {expected}; multiply the loss by loss_scale() before the backward"
            )));
        }
        let mut reducer = self.reducer()?;
        let waited = Instant::now();
        reducer.take_rest(|slot| (slot.take_param)(&mut grads));
        let (reduced, late, _) = finish(reducer)?;
        self.stats = ZeroStepStats {
            comm_wait: waited.elapsed(),
            overlapped_units: 0,
        };
        self.add(reduced, late);
        Ok(())
    }

    /// A reduction of the replica's gradients, at this engine's stage.
    fn reducer(&self) -> Result<Reducer<B>, ZeroError> {
        let slots = params::trainable::<B, M>(self.module());
        if slots.len() != self.names.len() {
            return Err(ZeroError::Config(format!(
                "the module had {} trainable parameters when wrapped and has {} now; wrap the new module in a new engine",
                self.names.len(),
                slots.len()
            )));
        }
        let reduction = match self.stage {
            ZeroStage::OptimizerState => Reduction::Whole,
            _ => Reduction::Part,
        };
        Ok(
            Reducer::new(slots, self.buckets.clone(), reduction, self.comm.clone())?
                .reduce_in(self.config.reduce_dtype())
                .known_late(self.late.clone()),
        )
    }

    /// Adds one reduction's gradients to this step's, and remembers which parameters got late
    /// parts.
    fn add(&mut self, reduced: UnitGrads<B>, late: Vec<bool>) {
        for (known, now) in self.late.iter_mut().zip(late) {
            *known |= now;
        }
        self.grads = Some(match self.grads.take() {
            None => reduced,
            Some(sum) => sum.into_iter().zip(reduced).map(|(a, b)| a + b).collect(),
        });
    }

    /// Steps this rank's shard with the gradients of the backwards since the last step, then
    /// all-gathers every shard into the replica; under loss scaling, a step whose gradients
    /// overflowed on some rank is skipped on every rank.
    pub fn step(&mut self, lr: f64) -> Result<StepOutcome, ZeroError> {
        let grads = self.grads.take().ok_or_else(|| {
            ZeroError::Config(
                "step without a backward since the last one; call backward first".into(),
            )
        })?;
        let rank = self.comm.rank();
        let grad_bytes = grads.iter().map(bytes).sum();
        let slots = params::trainable::<B, M>(self.module());
        let grads: Vec<_> = grads
            .into_iter()
            .enumerate()
            .map(|(u, g)| match self.stage {
                ZeroStage::OptimizerState => {
                    let range = self.layout.shard_range(u, rank);
                    to_f32(g.narrow(0, range.start, range.len()))
                }
                _ => to_f32(g),
            })
            .collect();
        let agree = self.overflow_group.as_ref().unwrap_or(&self.comm);
        let grads = match unscale(agree, self.scaler.as_mut(), grads)? {
            Ok(grads) => grads,
            Err(skipped) => return Ok(skipped),
        };
        let (grads, norm) = clip_global_norm(&self.comm, grads, self.config.max_grad_norm)?;
        self.grad_norm = norm;
        let (layout, values) = (&self.layout, &slots);
        let updated = self.optimizer.step(lr, grads, || {
            let values: Vec<_> = values.iter().map(|s| s.value.clone()).collect();
            (0..layout.units.len())
                .map(|u| to_f32(layout.shard_of(u, rank, &values)))
                .collect()
        });

        drop(slots);
        let new_values = self.gather(updated, true)?;
        let module = self
            .module
            .take()
            .expect("the module is back after every step");
        self.module = Some(load_trainable(module, new_values, None));
        let params_bytes = params::slots::<B, M>(self.module())
            .iter()
            .map(ParamSlot::bytes)
            .sum();
        self.memory = ModelStateBytes {
            params: params_bytes,
            grads: grad_bytes,
            optimizer: self.optimizer.state_bytes().0,
            host: self.optimizer.state_bytes().1,
        };
        Ok(StepOutcome::Applied)
    }

    /// The replica with the fp32 master weights in place of its 16-bit parameters, frozen ones
    /// widened to fp32: for export. All-gathers, so every rank calls it. Without mixed
    /// precision, the replica as it is.
    pub fn master_module(&self) -> Result<M, ZeroError> {
        let device = params::slots::<B, M>(self.module())[0].device.clone();
        let Some(master) = self.optimizer.master(&device) else {
            return Ok(self.module().clone());
        };
        let values = self.gather(master, false)?;
        Ok(load_trainable(
            self.module().clone(),
            values,
            Some(DType::F32),
        ))
    }

    /// Every trainable parameter's value from this rank's fp32 `parts` (one per unit),
    /// all-gathered unit by unit, each in the unit's dtype (`narrow`) or in fp32.
    fn gather(
        &self,
        parts: Vec<Tensor<Inner<B>, 1>>,
        narrow: bool,
    ) -> Result<Vec<Option<Tensor<Inner<B>, 1>>>, ZeroError> {
        let gathers: Vec<_> = parts
            .into_iter()
            .zip(&self.layout.units)
            .map(|(part, unit)| {
                let part = if narrow { cast(part, unit.dtype) } else { part };
                self.comm.all_gather_async(part, 0)
            })
            .collect();
        let mut values = vec![None; self.names.len()];
        for (u, work) in gathers.into_iter().enumerate() {
            let unit = &self.layout.units[u];
            for (&p, value) in unit
                .params
                .iter()
                .zip(self.layout.unflatten(u, work.wait()?))
            {
                values[p] = Some(value);
            }
        }
        Ok(values)
    }
}

/// `module` with its trainable parameters' values replaced by `values`; frozen ones stay, cast
/// to `dtype` when given.
fn load_trainable<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    values: Vec<Option<Tensor<Inner<B>, 1>>>,
    dtype: Option<DType>,
) -> M {
    let mut values = values.into_iter();
    let all: Vec<_> = params::slots::<B, M>(&module)
        .into_iter()
        .map(|slot| {
            if slot.require_grad {
                values
                    .next()
                    .flatten()
                    .expect("a value per trainable parameter")
            } else {
                match dtype {
                    Some(dtype) => cast(slot.value, dtype),
                    None => slot.value,
                }
            }
        })
        .collect();
    params::load::<B, M>(module, all)
}

/// `grads` (the parts of this rank's fp32 share, summed over the step's backwards) divided by
/// the loss scale; or, when they overflowed on some rank, the skipped step, the scale backed
/// off. Without loss scaling, `grads` as they are.
pub(crate) fn unscale<B: Backend>(
    comm: &Communicator,
    scaler: Option<&mut LossScaler>,
    grads: Vec<Tensor<B, 1>>,
) -> Result<Result<Vec<Tensor<B, 1>>, StepOutcome>, ZeroError> {
    let Some(scaler) = scaler else {
        return Ok(Ok(grads));
    };
    let scale = scaler.scale();
    match scaler.update(overflowed(comm, &grads)?) {
        StepOutcome::Applied => Ok(Ok(grads.into_iter().map(|grad| grad / scale).collect())),
        skipped => Ok(Err(skipped)),
    }
}

/// Backward of `loss` with each unit's gradients reduced by `reducer` as they complete;
/// returns each unit's reduced gradient, the parameters that got late parts, and where the
/// time went.
fn reduce<B: BackwardHooks>(
    loss: Tensor<B, 1>,
    reducer: Reducer<B>,
    overlap: bool,
) -> Result<(UnitGrads<B>, Vec<bool>, ZeroStepStats), ZeroError> {
    let (mut reducer, mut grads) = reducer.backward(loss, overlap);
    reducer.take_rest(|slot| (slot.take)(&mut grads));
    let waited = Instant::now();
    let (reduced, late, overlapped_units) = finish(reducer)?;
    Ok((
        reduced,
        late,
        ZeroStepStats {
            comm_wait: waited.elapsed(),
            overlapped_units,
        },
    ))
}

/// Waits for `reducer`'s units: each unit's reduced gradient, the parameters that got late
/// parts, and how many units started during backward. Every rank must have had a gradient for
/// every parameter: a rank without one would step a stale shard.
fn finish<B: AutodiffBackend>(
    reducer: Reducer<B>,
) -> Result<(UnitGrads<B>, Vec<bool>, usize), ZeroError> {
    let reduced = reducer.finish()?;
    let missing = reduced.missing();
    if !missing.is_empty() {
        return Err(ZeroError::MissingGradients(missing));
    }
    Ok((reduced.buffers, reduced.late, reduced.overlapped))
}
