//! ZeRO-3: the model runs as a chain of units, one block each (the embedding with the first,
//! the final norm and head with the last), each gathered from its shards for its forward and
//! again for its backward; each rank keeps and steps only its shard.

use crate::dims::Groups;
use burn::module::AutodiffModule;
use burn_checkpoint::Checkpoint;
use burn_comm::{Communicator, ReduceOp};
use burn_zero::{FullyShardedDataParallel, ParamRange};

use super::{Engine, Finished, Stepped, TrainBackend, ZeroStep};
use crate::batches::Batches;
use crate::checkpoint::{self, TrainingState};
use crate::model::Llama;
use crate::parallel_plan::{ParallelPlan, Slices};
use crate::train::{TrainConfig, TrainError};
use crate::weights::Weights;

pub(crate) struct FullyShardedEngine<'a, B: TrainBackend> {
    plan: &'a ParallelPlan,
    /// The tensor-parallel group each unit is cut over, if any.
    tp: Option<burn_tensor_parallel::TensorParallel>,
    fsdp: FullyShardedDataParallel<B, Llama<B>>,
    dp: Communicator,
}

impl<'a, B: TrainBackend> FullyShardedEngine<'a, B> {
    /// Shards the plan's units of `weights` (each holding this rank's tp slices) over `dp`.
    pub fn new(
        config: &TrainConfig,
        plan: &'a ParallelPlan,
        weights: &Weights,
        groups: &Groups,
        dp: Communicator,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let ranges = plan.units.as_ref().expect("ZeRO-3's plan has its units");
        let every: Vec<usize> = (0..ranges.len()).collect();
        // Built one unit at a time: a rank never holds every unit whole.
        let mut failed = None;
        let units = weights
            .each_part(&config.model, plan, ranges, &every, groups.slices(), device)
            .map_while(|unit| unit.map_err(|error| failed = Some(error)).ok())
            .map(|unit| groups.set_up(unit));
        let fsdp = FullyShardedDataParallel::new(
            units,
            dp.clone(),
            &config.optimizer(),
            config.zero_engine_config(),
        );
        if let Some(error) = failed {
            return Err(error);
        }
        let mut fsdp = fsdp?;
        if let Some(peers) = &groups.stage_peers {
            fsdp = fsdp.with_backward_group(peers.clone());
        }
        // Tensor-parallel peers skip the same steps for overflow.
        if let Some(world) = &groups.world {
            fsdp = fsdp.with_overflow_group(world.clone());
        }
        Ok(Self {
            plan,
            tp: groups.tp.clone(),
            fsdp,
            dp,
        })
    }
}

impl<B: TrainBackend> FullyShardedEngine<'_, B> {
    /// Where this rank's parameters sit: each unit's first block, and their tp group.
    fn held(&self) -> checkpoint::Held<'_> {
        let units = self
            .plan
            .units
            .as_ref()
            .expect("ZeRO-3's plan has its units");
        let first_layers = units.iter().map(|unit| unit.start).collect();
        checkpoint::Held::parts(self.plan, first_layers, Slices::tp(self.tp.as_ref()))
    }

    /// This rank's ranges, each named with its unit's index first.
    fn ranges(&self) -> Vec<ParamRange> {
        let units = self.fsdp.shard_range_units();
        let ranges = self.fsdp.shard_ranges().into_iter().zip(units);
        ranges
            .map(|(range, unit)| ParamRange {
                name: format!("{unit}.{}", range.name),
                ..range
            })
            .collect()
    }
}

impl<B: TrainBackend> Engine<B> for FullyShardedEngine<'_, B> {
    fn forward_backward(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        let accum = batches.micro_batches();
        let mut loss_sum = 0.0;
        for micro in 0..accum {
            let batch = batches.micro(step, micro, device);
            loss_sum += self.fsdp.forward_backward(&batch, 1.0 / accum as f64)?;
        }
        Ok(loss_sum / accum as f64)
    }

    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        let loss_scale = self.fsdp.loss_scale();
        let outcome = self.fsdp.step(lr)?;
        Ok(Stepped {
            comm_wait_s: 0.0,
            zero: Some(ZeroStep {
                bytes: self.fsdp.memory().total(),
                loss_scale,
                outcome,
            }),
            grad_norm: self.fsdp.grad_norm(),
        })
    }

    fn checkpoint_pieces(&self) -> Result<TrainingState, TrainError> {
        let mut state = self.fsdp.shard_tensors();
        state.ranges = self.ranges();
        checkpoint::zero_pieces(&self.held(), state)
    }

    fn restore(&mut self, from: &Checkpoint, _: &B::Device) -> Result<(), TrainError> {
        let moments = checkpoint::zero_moments(&self.held(), &self.ranges(), from)?;
        let (steps, loss_scale) = (checkpoint::adam_steps(from)?, checkpoint::loss_scale(from)?);
        self.fsdp
            .restore_state(moments.as_ref(), steps, loss_scale)?;
        Ok(())
    }

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        vec![(self.dp.clone(), ReduceOp::Avg)]
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        let Self { plan, fsdp, .. } = *self;
        let units = fsdp
            .into_full_master()?
            .into_iter()
            .map(|unit| plan.gather(unit.valid()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Finished {
            model: Llama::join(units),
            spans: Vec::new(),
        })
    }
}
