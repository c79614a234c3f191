//! Pipeline stages whose blocks are tensor-parallel (pp x tp): a dense [`LlamaStage`] sliced
//! over the tensor-parallel group exactly as [`TpLlama`](crate::tensor_parallel::TpLlama)
//! slices the whole model, and gathered back at the end. Every tensor-parallel rank of a stage
//! sends its own copy of the activations to its peer in the next stage (under sequence
//! parallelism, its part of the sequence).

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_pipeline::{PipelineStage, StageOutput};
use burn_tensor_parallel::{
    ColumnParallelLinear, TensorParallel, TpBackend, TpError, VocabParallelEmbedding,
};

use crate::config::LlamaConfig;
use crate::model::RmsNorm;
use crate::pipeline::{LlamaStage, MicroBatch, stage_input, stage_positions};
use crate::tensor_parallel::{TpBlock, TpHead, head_loss};
use crate::train::TrainError;

/// A run of consecutive tensor-parallel blocks, with the vocab-parallel embedding on the first
/// stage and the final norm, vocab-parallel head and loss on the last.
#[derive(Module, Debug)]
pub struct TpLlamaStage<B: Backend> {
    /// The embedding split by vocabulary, on the first stage.
    pub embed_tokens: Option<VocabParallelEmbedding<B>>,
    /// This stage's blocks.
    pub layers: Vec<TpBlock<B>>,
    /// Final norm (every rank holds it whole), on the last stage.
    pub norm: Option<RmsNorm<B>>,
    /// The head split by vocabulary, on the last stage.
    pub lm_head: Option<ColumnParallelLinear<B>>,
    #[module(skip)]
    config: LlamaConfig,
    #[module(skip)]
    tp: TensorParallel,
}

impl<B: TpBackend> TpLlamaStage<B> {
    /// This rank's part of `stage`. A collective over `tp`.
    pub fn from_stage(stage: LlamaStage<B>, tp: &TensorParallel) -> Result<Self, TpError> {
        let config = stage.config().clone();
        let layers = stage
            .layers
            .into_iter()
            .map(|block| TpBlock::from_full(block, &config, tp))
            .collect::<Result<_, TpError>>()?;
        Ok(Self {
            embed_tokens: stage
                .embed_tokens
                .map(|table| VocabParallelEmbedding::from_full(table.val(), tp))
                .transpose()?,
            layers,
            norm: stage.norm,
            lm_head: stage
                .lm_head
                .map(|head| ColumnParallelLinear::from_full(head.val(), None, tp, false))
                .transpose()?,
            config,
            tp: tp.clone(),
        })
    }

    /// The whole stage, gathered from the group (a collective).
    pub fn full(&self) -> Result<LlamaStage<B>, TpError> {
        let layers = self
            .layers
            .iter()
            .map(|block| block.full(&self.config))
            .collect::<Result<_, TpError>>()?;
        Ok(LlamaStage::new(
            self.embed_tokens.as_ref().map(|e| e.full()).transpose()?,
            layers,
            self.norm.clone(),
            self.lm_head
                .as_ref()
                .map(|h| h.full().map(|(weight, _)| weight))
                .transpose()?,
            self.config.clone(),
        ))
    }
}

impl<B: AutodiffBackend + TpBackend> PipelineStage<B> for TpLlamaStage<B> {
    type Batch = MicroBatch<B>;
    type Error = TrainError;

    fn forward(
        &self,
        input: Option<Tensor<B, 3>>,
        (inputs, targets): &MicroBatch<B>,
    ) -> Result<StageOutput<B>, TrainError> {
        let mut x = stage_input(self.embed_tokens.as_ref(), input, |embedding| {
            Ok(embedding.forward(inputs.clone())?)
        })?;
        let positions = stage_positions(&self.config, targets, &x);
        for layer in &self.layers {
            x = layer.forward(x, &positions)?;
        }
        let Some(norm) = &self.norm else {
            return Ok(StageOutput::Activation(x));
        };
        let head = TpHead::of(self.lm_head.as_ref(), self.embed_tokens.as_ref())?;
        Ok(StageOutput::Loss(head_loss(
            norm,
            head,
            x,
            targets.clone(),
            &self.tp,
        )?))
    }
}
