//! ZeRO-3: the model runs as a chain of units, one block each (the embedding with the first,
//! the final norm and head with the last), each gathered from its shards for its forward and
//! again for its backward; each rank keeps and steps only its shard.

use burn::tensor::backend::AutodiffBackend;
use burn_comm::{Communicator, ReduceOp};
use burn_zero::FullyShardedDataParallel;

use super::{Engine, Finished, Split, Stepped, TrainableStage, ZeroStep};
use crate::batches::Batches;
use crate::config::LlamaConfig;
use crate::model::Llama;
use crate::pipeline::LlamaStage;
use crate::train::{TrainConfig, TrainError};

pub(crate) struct FullyShardedEngine<B: AutodiffBackend, S: TrainableStage<B>> {
    fsdp: FullyShardedDataParallel<B, S>,
    dp: Communicator,
}

/// ZeRO-3's units of `model`: one block each, the embedding with the first and the final norm
/// and head with the last.
pub(crate) fn units<B: AutodiffBackend>(
    model: Llama<B>,
    config: &LlamaConfig,
) -> Vec<LlamaStage<B>> {
    let ranges: Vec<_> = (0..config.num_hidden_layers).map(|i| i..i + 1).collect();
    LlamaStage::cut(model, config, &ranges)
}

impl<B: AutodiffBackend, S: TrainableStage<B>> FullyShardedEngine<B, S> {
    pub fn new<P: Split<B, Stage = S>>(
        config: &TrainConfig,
        split: &P,
        model: Llama<B>,
        dp: Communicator,
    ) -> Result<Self, TrainError> {
        let units = units(model, &config.model)
            .into_iter()
            .map(|unit| split.stage(unit))
            .collect::<Result<Vec<_>, _>>()?;
        let mut fsdp = FullyShardedDataParallel::new(
            units,
            dp.clone(),
            &config.optimizer(),
            config.zero_engine_config(),
        )?;
        if let Some(group) = split.backward_group() {
            fsdp = fsdp.with_backward_group(group);
        }
        Ok(Self { fsdp, dp })
    }
}

impl<B: AutodiffBackend, S: TrainableStage<B>> Engine<B> for FullyShardedEngine<B, S> {
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

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        vec![(self.dp.clone(), ReduceOp::Avg)]
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        let stages = self
            .fsdp
            .full_master()?
            .into_iter()
            .map(|unit| S::whole(unit.valid()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Finished {
            model: LlamaStage::join(stages),
            spans: Vec::new(),
        })
    }
}
