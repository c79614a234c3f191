//! ZeRO stage 1 as a burn `Optimizer` (PyTorch's `ZeroRedundancyOptimizer`): it takes the
//! gradients a data-parallel loop has already averaged, steps AdamW on this rank's shard of the
//! flat parameters only, so each rank holds 1/N of the moments, and all-gathers the updated
//! shards into every replica. It drops into any loop that calls `Optimizer::step`: burn-train's
//! `Learner` under burn-parallel-train's strategy, or a hand-written DDP loop.
//!
//! With [`ZeroAdamW::with_gradient_sharding`] it is ZeRO stage 2: it takes each rank's own
//! gradients instead and reduce-scatters them, so a rank receives only the average of its
//! shard; no rank ever holds the whole averaged gradient, and the reduction moves half the
//! bytes of the all-reduce it replaces.

use burn::module::AutodiffModule;
use burn::optim::{
    AdamWConfig, AdamWState, AdaptiveMomentumState, GradientsParams, MultiGradientsParams,
    Optimizer,
};
use burn::record::Record;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::MissingGradient;
use burn_ddp::params::{self, ParamSlot};

use crate::optimizer::{ShardedAdamW, to_f32};
use crate::{FlatLayout, ZeroError};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

thread_local! {
    static GRADIENT_SHARDING_STEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Steps taken on this thread by a [`ZeroAdamW`] with gradient sharding: a loop that hands an
/// optimizer each rank's own gradients (burn-parallel-train's strategy under ZeRO-2) checks by
/// it that the step did average them, rather than let every shard learn from one rank's batch.
pub fn gradient_sharding_steps() -> u64 {
    GRADIENT_SHARDING_STEPS.with(std::cell::Cell::get)
}

/// Parameters per flat unit, in bytes: units are all-gathered one by one after the step.
const UNIT_CAP_BYTES: usize = 25 << 20;

/// AdamW with its state sharded over a data-parallel group (ZeRO-1, or ZeRO-2 with
/// [`with_gradient_sharding`](Self::with_gradient_sharding)).
///
/// Every rank must pass a gradient for every trainable parameter (the flat shard steps all of
/// its elements): under ZeRO-1 the same, already averaged, gradients (DDP's or the
/// strategy's); under ZeRO-2 its own, which the step averages.
#[derive(Clone)]
pub struct ZeroAdamW<B: AutodiffBackend> {
    comm: Communicator,
    adamw: ShardedAdamW<Inner<B>>,
    /// Built from the module at the first step.
    layout: Option<FlatLayout>,
    /// ZeRO-2: the step reduce-scatters each rank's own gradients.
    shards_gradients: bool,
}

/// What [`ZeroAdamW`] checkpoints: this rank's shard of the moments, and whose shard it is.
#[derive(Record, Clone)]
pub struct ZeroAdamWRecord<B: burn::tensor::backend::Backend> {
    /// The rank whose shard this is.
    pub rank: usize,
    /// The group size it was sharded over.
    pub world: usize,
    /// The moments of the shard (none before the first step).
    pub state: Option<AdamWState<B, 1>>,
}

impl<B: AutodiffBackend> ZeroAdamW<B> {
    /// AdamW as `config` describes it, sharded over `comm`. A config that clips gradients is
    /// refused: burn clips each parameter's gradient alone, which a shard cannot reproduce.
    pub fn new(config: &AdamWConfig, comm: Communicator) -> Result<Self, ZeroError> {
        Ok(Self {
            comm,
            adamw: ShardedAdamW::new(config)?,
            layout: None,
            shards_gradients: false,
        })
    }

    /// ZeRO-2: the step takes each rank's own (summed, not averaged) gradients and
    /// reduce-scatters them unit by unit, averaging, so this rank receives its shard of the
    /// average only. The loop must not average them first (burn-parallel-train's strategy:
    /// `with_sharded_gradients`).
    pub fn with_gradient_sharding(mut self) -> Self {
        self.shards_gradients = true;
        self
    }

    /// Whether the step averages the gradients itself (ZeRO-2).
    pub fn shards_gradients(&self) -> bool {
        self.shards_gradients
    }

    /// Bytes of optimizer state this rank holds (none before the first step).
    pub fn state_bytes(&self) -> usize {
        self.adamw.state_bytes()
    }

    fn try_step<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<M, ZeroError> {
        let all = params::slots::<B, M>(&module);
        let trainable: Vec<usize> = (0..all.len()).filter(|&i| all[i].require_grad).collect();
        let slots: Vec<&ParamSlot<B>> = trainable.iter().map(|&i| &all[i]).collect();
        if let Some(slot) = slots.iter().find(|s| s.dtype != DType::F32) {
            return Err(ZeroError::Config(format!(
                "ZeroAdamW steps f32 parameters; `{}` is {:?} (for 16-bit parameters use burn-zero's ShardedDataParallel with MixedPrecision)",
                slot.name, slot.dtype
            )));
        }
        let mut missing = Vec::new();
        let grad: Vec<Tensor<Inner<B>, 1>> = slots
            .iter()
            .map(|slot| {
                (slot.take_param)(&mut grads).unwrap_or_else(|| {
                    missing.push(MissingGradient {
                        name: slot.name.clone(),
                        ranks: vec![self.comm.rank()],
                    });
                    Tensor::zeros([slot.numel], &slot.device)
                })
            })
            .collect();
        if self.shards_gradients {
            // The ranks' own gradients: one may lack one the others have. They agree first,
            // so that all fail together rather than leave the others in the reduce-scatter.
            missing = self.missing_anywhere(&slots, &missing)?;
        }
        if !missing.is_empty() {
            return Err(ZeroError::MissingGradients(missing));
        }
        let layout = self.layout(&slots)?;
        let rank = self.comm.rank();
        let values: Vec<Tensor<Inner<B>, 1>> = slots.iter().map(|s| s.value.clone()).collect();
        let units = 0..layout.units.len();
        let shard = |of: &[Tensor<Inner<B>, 1>]| {
            params::concat(
                units
                    .clone()
                    .map(|u| layout.shard_of(u, rank, of))
                    .collect(),
            )
        };
        let grad = match self.shards_gradients {
            false => shard(&grad),
            true => {
                // Every unit's reduce-scatter in flight at once.
                let scatters: Vec<_> = units
                    .clone()
                    .map(|u| {
                        let parts = layout.units[u].params.iter().map(|&p| grad[p].clone());
                        let flat = layout.flatten(u, parts.collect());
                        self.comm.reduce_scatter_async(flat, ReduceOp::Avg, 0)
                    })
                    .collect();
                let parts = scatters
                    .into_iter()
                    .map(|work| work.wait())
                    .collect::<Result<Vec<_>, _>>()?;
                params::concat(parts)
            }
        };
        if self.shards_gradients {
            GRADIENT_SHARDING_STEPS.with(|steps| steps.set(steps.get() + 1));
        }
        let grad = to_f32(grad);
        let weights = shard(&values);
        let updated = self.adamw.step(lr, grad, || weights);

        // Every unit's shards gathered, all in flight at once.
        let gathers: Vec<_> = layout
            .split_shard(updated)
            .into_iter()
            .map(|part| self.comm.all_gather_async(part, 0))
            .collect();
        let mut new_values: Vec<Option<Tensor<Inner<B>, 1>>> = vec![None; all.len()];
        for (unit, work) in gathers.into_iter().enumerate() {
            let full = work.wait()?;
            for (&p, value) in layout.units[unit]
                .params
                .iter()
                .zip(layout.unflatten(unit, full))
            {
                new_values[trainable[p]] = Some(value);
            }
        }
        let values = all
            .iter()
            .zip(new_values)
            .map(|(slot, new)| new.unwrap_or_else(|| slot.value.clone()))
            .collect();
        Ok(params::load::<B, M>(module, values))
    }

    /// Every rank's missing gradients, gathered from this rank's `missing`: the same list on
    /// every rank.
    fn missing_anywhere(
        &self,
        slots: &[&ParamSlot<B>],
        missing: &[MissingGradient],
    ) -> Result<Vec<MissingGradient>, ZeroError> {
        let Some(first) = slots.first() else {
            return Ok(Vec::new());
        };
        let lacks: Vec<f32> = slots
            .iter()
            .map(|s| f32::from(missing.iter().any(|m| m.name == s.name)))
            .collect();
        let n = lacks.len();
        let mine = Tensor::<Inner<B>, 2>::from_data(TensorData::new(lacks, [1, n]), &first.device);
        let all: Vec<f32> = self
            .comm
            .all_gather(mine, 0)?
            .into_data()
            .to_vec()
            .map_err(|e| ZeroError::Config(format!("the missing gradients: {e:?}")))?;
        Ok(slots
            .iter()
            .enumerate()
            .filter_map(|(p, slot)| {
                let ranks: Vec<usize> = (0..self.comm.size())
                    .filter(|&r| all[r * n + p] > 0.0)
                    .collect();
                (!ranks.is_empty()).then(|| MissingGradient {
                    name: slot.name.clone(),
                    ranks,
                })
            })
            .collect())
    }

    /// The layout of the first step, checked against this step's parameters.
    fn layout(&mut self, slots: &[&ParamSlot<B>]) -> Result<FlatLayout, ZeroError> {
        let numels: Vec<usize> = slots.iter().map(|s| s.numel).collect();
        if let Some(layout) = &self.layout {
            if layout.numels != numels {
                let changed = (0..numels.len().max(layout.numels.len()))
                    .find(|&i| layout.numels.get(i) != numels.get(i))
                    .expect("the lists differ somewhere");
                let name = slots.get(changed).map_or("(none)", |s| s.name.as_str());
                return Err(ZeroError::Config(format!(
                    "the module's trainable parameters changed since ZeroAdamW's first step: {} then, {} now, first differing at #{changed} `{name}` ({:?} elements then, {:?} now); build a new ZeroAdamW for a new module",
                    layout.numels.len(),
                    numels.len(),
                    layout.numels.get(changed),
                    numels.get(changed)
                )));
            }
            return Ok(layout.clone());
        }
        let dtypes = vec![DType::F32; numels.len()];
        let order: Vec<usize> = (0..numels.len()).collect();
        let layout =
            FlatLayout::bucketed(&numels, &dtypes, &order, UNIT_CAP_BYTES, self.comm.size())?;
        self.layout = Some(layout.clone());
        Ok(layout)
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Optimizer<M, B> for ZeroAdamW<B> {
    type Record = ZeroAdamWRecord<B>;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.try_step(lr, module, grads).unwrap_or_else(|e| {
            panic!(
                "ZeroAdamW's step failed on rank {} of {}: {e}",
                self.comm.rank(),
                self.comm.size()
            )
        })
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        // burn-train's multi-device strategy; this optimizer is for one device per rank.
        let _ = (lr, &module, grads);
        panic!(
            "ZeroAdamW takes one device's gradients per rank; burn-train's multi-device strategy is not data parallelism over a group, use burn-parallel-train's strategy"
        )
    }

    fn to_record(&self) -> ZeroAdamWRecord<B> {
        ZeroAdamWRecord {
            rank: self.comm.rank(),
            world: self.comm.size(),
            state: self.adamw.state().map(|s| {
                let m = &s.momentum;
                AdamWState::new(AdaptiveMomentumState {
                    time: m.time,
                    moment_1: Tensor::from_inner(m.moment_1.clone()),
                    moment_2: Tensor::from_inner(m.moment_2.clone()),
                    max_moment_2: m.max_moment_2.clone().map(Tensor::from_inner),
                })
            }),
        }
    }

    fn load_record(self, record: ZeroAdamWRecord<B>) -> Self {
        let (rank, world) = (self.comm.rank(), self.comm.size());
        if (record.rank, record.world) != (rank, world) {
            panic!(
                "this ZeroAdamW checkpoint holds the optimizer shard of rank {} of {}, and this is rank {rank} of {world}: give every rank its own checkpoint directory and resume with the same number of ranks",
                record.rank, record.world
            );
        }
        let state = record.state.map(|s| {
            let m = s.momentum;
            AdamWState::new(AdaptiveMomentumState {
                time: m.time,
                moment_1: m.moment_1.inner(),
                moment_2: m.moment_2.inner(),
                max_moment_2: m.max_moment_2.map(Tensor::inner),
            })
        });
        Self {
            adamw: self.adamw.with_state(state),
            ..self
        }
    }
}
