//! One replica and plain burn: no data-parallel group. The oracle every other engine is held
//! to, and the baseline of the benches (with tensor parallelism, the replica is split over its
//! group and still trains alone).

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, GradientsAccumulator, GradientsParams, Optimizer};
use burn_checkpoint::Checkpoint;
use burn_comm::{Communicator, ReduceOp};

use super::{Engine, Finished, Stepped, TrainBackend};
use crate::batches::Batches;
use crate::checkpoint::{self, TrainingState};
use crate::model::Llama;
use crate::parallel_plan::ParallelPlan;
use crate::train::{TrainConfig, TrainError, scalar};

pub(crate) struct SingleEngine<'a, B: TrainBackend> {
    config: &'a TrainConfig,
    plan: &'a ParallelPlan,
    /// Always present between calls; taken only while the optimizer steps it.
    model: Option<Llama<B>>,
    optimizer: OptimizerAdaptor<AdamW, Llama<B>, B>,
    /// The step's accumulated gradients, between backward and step.
    grads: Option<GradientsParams>,
}

impl<'a, B: TrainBackend> SingleEngine<'a, B> {
    pub fn new(config: &'a TrainConfig, plan: &'a ParallelPlan, model: Llama<B>) -> Self {
        Self {
            config,
            plan,
            model: Some(model),
            optimizer: config.optimizer().init::<B, Llama<B>>(),
            grads: None,
        }
    }
}

impl<B: TrainBackend> Engine<B> for SingleEngine<'_, B> {
    fn forward_backward(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        let accum = batches.micro_batches();
        let mut accumulator = GradientsAccumulator::new();
        let mut loss_sum = 0.0;
        let model = self
            .model
            .as_ref()
            .expect("the model is back after each step");
        for micro in 0..accum {
            let (inputs, targets) = batches.micro(step, micro, device);
            let loss = model.loss(inputs, targets)? / accum as f64;
            loss_sum += scalar(&loss);
            let grads = GradientsParams::from_grads(loss.backward(), model);
            accumulator.accumulate(model, grads);
        }
        self.grads = Some(accumulator.grads());
        Ok(loss_sum)
    }

    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        let grads = self.grads.take().expect("forward_backward ran first");
        let model = self
            .model
            .take()
            .expect("the model is back after each step");
        let (grads, grad_norm) = self.config.clip(&model, grads);
        self.model = Some(self.optimizer.step(lr, model, grads));
        Ok(Stepped {
            grad_norm,
            ..Stepped::default()
        })
    }

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        // A split replica computes the same loss on every rank of its group.
        Vec::new()
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        let trained = self.model.expect("the model is back after each step");
        Finished::gathered(self.plan, trained.valid())
    }

    fn checkpoint_pieces(&self) -> Result<TrainingState, TrainError> {
        let model = self
            .model
            .as_ref()
            .expect("the model is back after each step");
        checkpoint::adamw_pieces(
            &checkpoint::Held::of(self.plan, model),
            model,
            &self.optimizer,
        )
    }

    fn restore(&mut self, from: &Checkpoint, device: &B::Device) -> Result<(), TrainError> {
        let model = self
            .model
            .as_ref()
            .expect("the model is back after each step");
        let fresh = self.config.optimizer().init::<B, Llama<B>>();
        let optimizer = std::mem::replace(&mut self.optimizer, fresh);
        let held = checkpoint::Held::of(self.plan, model);
        self.optimizer = checkpoint::load_adamw(&held, model, optimizer, from, device)?;
        Ok(())
    }
}
