//! DistributedDataParallel: every rank holds the replica; gradients are averaged in buckets
//! while the last micro-batch's backward runs, then every rank steps alike.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, GradientsParams};
use burn_checkpoint::Checkpoint;
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::{DistributedDataParallel, ExpertGroup};

use super::{Engine, Finished, Stepped, TrainBackend};
use crate::batches::Batches;
use crate::checkpoint::{self, TrainingState};
use crate::model::Llama;
use crate::parallel_plan::ParallelPlan;
use crate::train::{TrainConfig, TrainError, scalar};

pub(crate) struct DdpEngine<'a, B: TrainBackend> {
    config: &'a TrainConfig,
    plan: &'a ParallelPlan,
    ddp: DistributedDataParallel<B, Llama<B>>,
    optimizer: OptimizerAdaptor<AdamW, Llama<B>, B>,
    /// The step's averaged gradients, between backward and step.
    grads: Option<GradientsParams>,
}

impl<'a, B: TrainBackend> DdpEngine<'a, B> {
    /// DDP of `model` over `dp`; `experts` are the weights held by some of its ranks only.
    pub fn new(
        config: &'a TrainConfig,
        plan: &'a ParallelPlan,
        model: Llama<B>,
        dp: Communicator,
        experts: Option<ExpertGroup>,
    ) -> Result<Self, TrainError> {
        Ok(Self {
            config,
            plan,
            ddp: DistributedDataParallel::with_experts(model, dp, experts, config.ddp.clone())?,
            optimizer: config.optimizer().init::<B, Llama<B>>(),
            grads: None,
        })
    }
}

impl<B: TrainBackend> Engine<B> for DdpEngine<'_, B> {
    fn forward_backward(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        let accum = batches.micro_batches();
        let mut loss_sum = 0.0;
        for micro in 0..accum {
            let (inputs, targets) = batches.micro(step, micro, device);
            let loss = self.ddp.module().loss(inputs, targets)? / accum as f64;
            loss_sum += scalar(&loss);
            if micro + 1 < accum {
                self.ddp.backward_no_sync(loss);
            } else {
                self.grads = Some(self.ddp.backward(loss)?);
            }
        }
        Ok(loss_sum)
    }

    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        let grads = self
            .grads
            .take()
            .expect("the last micro-batch synchronises");
        let (grads, grad_norm) = self.config.clip(self.ddp.module(), grads);
        self.ddp.step(&mut self.optimizer, lr, grads);
        Ok(Stepped {
            comm_wait_s: self.ddp.stats().comm_wait.as_secs_f64(),
            zero: None,
            grad_norm,
        })
    }

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        vec![(self.ddp.comm().clone(), ReduceOp::Avg)]
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        Finished::gathered(self.plan, self.ddp.into_module().valid())
    }

    fn checkpoint_pieces(&self) -> Result<TrainingState, TrainError> {
        let held = checkpoint::Held::of(self.plan, self.ddp.module());
        checkpoint::adamw_pieces(&held, self.ddp.module(), &self.optimizer)
    }

    fn restore(&mut self, from: &Checkpoint, device: &B::Device) -> Result<(), TrainError> {
        let fresh = self.config.optimizer().init::<B, Llama<B>>();
        let optimizer = std::mem::replace(&mut self.optimizer, fresh);
        let held = checkpoint::Held::of(self.plan, self.ddp.module());
        self.optimizer = checkpoint::load_adamw(&held, self.ddp.module(), optimizer, from, device)?;
        Ok(())
    }
}
