//! ZeRO-1 and ZeRO-2 over the data-parallel group: each micro-batch's gradients are reduced as
//! its backward runs and summed; each rank steps its shard of the optimizer state and gathers
//! the rest of the parameters.

use burn::module::AutodiffModule;
use burn_checkpoint::Checkpoint;
use burn_comm::{Communicator, ReduceOp};
use burn_zero::ShardedDataParallel;

use super::{Engine, Finished, Stepped, TrainBackend, ZeroStep};
use crate::batches::Batches;
use crate::checkpoint::{self, TrainingState};
use crate::model::Llama;
use crate::parallel_plan::ParallelPlan;
use crate::train::{TrainConfig, TrainError, scalar};

pub(crate) struct ShardedEngine<'a, B: TrainBackend> {
    plan: &'a ParallelPlan,
    zero: ShardedDataParallel<B, Llama<B>>,
    /// Seconds waited for the step's gradient communication so far.
    comm_wait_s: f64,
}

impl<'a, B: TrainBackend> ShardedEngine<'a, B> {
    pub fn new(
        config: &TrainConfig,
        plan: &'a ParallelPlan,
        model: Llama<B>,
        dp: Communicator,
        world: Option<Communicator>,
    ) -> Result<Self, TrainError> {
        let mut zero = ShardedDataParallel::new(
            model,
            dp,
            config.zero,
            &config.optimizer(),
            config.zero_engine_config(),
        )?;
        // Tensor-parallel peers skip the same steps for overflow.
        if let Some(world) = world {
            zero = zero.with_overflow_group(world);
        }
        Ok(Self {
            plan,
            zero,
            comm_wait_s: 0.0,
        })
    }
}

impl<B: TrainBackend> Engine<B> for ShardedEngine<'_, B> {
    fn forward_backward(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        let accum = batches.micro_batches();
        let mut loss_sum = 0.0;
        self.comm_wait_s = 0.0;
        for micro in 0..accum {
            let (inputs, targets) = batches.micro(step, micro, device);
            let loss = self.zero.module().loss(inputs, targets)? / accum as f64;
            loss_sum += scalar(&loss);
            self.zero.backward(loss)?;
            self.comm_wait_s += self.zero.stats().comm_wait.as_secs_f64();
        }
        Ok(loss_sum)
    }

    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        let zero = ZeroStep::sharded(&mut self.zero, lr)?;
        Ok(Stepped {
            comm_wait_s: self.comm_wait_s,
            zero: Some(zero),
            // The norm of the step just taken.
            grad_norm: self.zero.grad_norm(),
        })
    }

    fn checkpoint_pieces(&self) -> Result<TrainingState, TrainError> {
        let held = checkpoint::Held::of(self.plan, self.zero.module());
        checkpoint::zero_pieces(&held, self.zero.shard_tensors())
    }

    fn restore(&mut self, from: &Checkpoint, _: &B::Device) -> Result<(), TrainError> {
        let held = checkpoint::Held::of(self.plan, self.zero.module());
        let moments = checkpoint::zero_moments(&held, &self.zero.shard_ranges(), from)?;
        let (steps, loss_scale) = (checkpoint::adam_steps(from)?, checkpoint::loss_scale(from)?);
        self.zero
            .restore_state(moments.as_ref(), steps, loss_scale)?;
        Ok(())
    }

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        vec![(self.zero.comm().clone(), ReduceOp::Avg)]
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        Finished::gathered(self.plan, self.zero.master_module()?.valid())
    }
}
