//! The Llama decoder as pipeline stages: its blocks cut into `pp x virtual_stages` contiguous
//! stages balanced by parameter count or measured time, the first holding the embedding and
//! the last the final norm, head and loss. The pipeline engine (`engine/pipeline.rs`) trains
//! them.

use std::fmt;
use std::ops::Range;
use std::time::Instant;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor};
use burn_comm::{CommError, Communicator};
use burn_pipeline::{PipelineStage, Schedule, StageOutput, balance};
use burn_tensor_parallel::{TensorParallel, TpBackend};
use serde::Serialize;

use crate::config::LlamaConfig;
use crate::dims::Groups;
use crate::model::{Llama, Positions, embed, head, next_token_loss};
use crate::train::TrainError;

/// Inputs and targets of one micro-batch.
pub type MicroBatch<B> = (Tensor<B, 2, Int>, Tensor<B, 2, Int>);

/// A stage is a [`Llama`] holding a range of blocks.
impl<B: AutodiffBackend + TpBackend> PipelineStage<B> for Llama<B> {
    type Batch = MicroBatch<B>;
    type Error = TrainError;

    fn forward(
        &self,
        input: Option<Tensor<B, 3>>,
        (inputs, targets): &MicroBatch<B>,
    ) -> Result<StageOutput<B>, TrainError> {
        Ok(self.forward_part(input, inputs, targets)?)
    }
}

/// How the blocks are shared out among the pipeline stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
pub enum Balance {
    /// Even parameter counts, the embedding counting on the first stage and the final norm and
    /// head on the last.
    #[default]
    Params,
    /// Even forward + backward time of a micro-batch, each block, the embedding and the head
    /// timed alone on the first rank before training and shared with every rank.
    Time,
}

impl fmt::Display for Balance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Balance::Params => "params",
            Balance::Time => "time",
        })
    }
}

/// What each block, the embedding, and the final norm with the head and loss cost, in one unit.
#[derive(Debug, Clone, PartialEq)]
pub struct StageCosts {
    /// Each block's.
    pub blocks: Vec<f64>,
    /// The embedding's, on the first stage.
    pub embedding: f64,
    /// The final norm's, head's and loss's, on the last stage.
    pub tail: f64,
}

impl StageCosts {
    /// Parameter counts.
    pub fn params(config: &LlamaConfig) -> Self {
        let (h, v) = (config.hidden_size as f64, config.vocab_size as f64);
        let total = config.num_params() as f64;
        let embedding = v * h;
        // A tied head has no parameters of its own, but the last stage holds a copy of the
        // embedding for it and does the head's work: it costs as much either way.
        let own_head = if config.tie_word_embeddings {
            0.0
        } else {
            h * v
        };
        let tail = h + h * v;
        let block = (total - embedding - h - own_head) / config.num_hidden_layers as f64;
        Self {
            blocks: vec![block; config.num_hidden_layers],
            embedding,
            tail,
        }
    }

    /// Seconds of forward + backward of `batch` through each part of `model` alone, the fastest
    /// of a few runs after a warm-up.
    pub fn time<B: AutodiffBackend + TpBackend>(
        model: &Llama<B>,
        config: &LlamaConfig,
        (inputs, targets): &MicroBatch<B>,
    ) -> Result<Self, TrainError> {
        const RUNS: usize = 3;
        let device = inputs.device();
        let time = |work: &dyn Fn()| -> Result<f64, TrainError> {
            let mut fastest = f64::INFINITY;
            for run in 0..=RUNS {
                let started = Instant::now();
                work();
                B::sync(&device).map_err(|e| {
                    TrainError::Config(format!("timing the stages failed on the device: {e:?}"))
                })?;
                if run > 0 {
                    fastest = fastest.min(started.elapsed().as_secs_f64());
                }
            }
            Ok(fastest)
        };
        // Every block and the head take the embedding's output, as in training.
        let table = model
            .embed_tokens
            .as_ref()
            .ok_or_else(|| TrainError::Config("the stages are timed on the whole model".into()))?;
        let x = embed(table, inputs.clone()).detach();
        let positions = Positions::new(config, targets.dims()[1], &x, None)?;
        let embedding = time(&|| {
            embed(table, inputs.clone()).sum().backward();
        })?;
        let blocks = model
            .layers
            .iter()
            .enumerate()
            .map(|(index, block)| {
                time(&|| {
                    let (y, _) = block
                        .forward(x.clone().require_grad(), &positions, None, None, index)
                        .expect("a block held whole makes no collective that could fail");
                    y.sum().backward();
                })
            })
            .collect::<Result<_, _>>()?;
        let norm = model
            .norm
            .as_ref()
            .expect("the whole model has its final norm");
        let tail = time(&|| {
            let weight = model.head_weight().expect("the whole model has its head");
            let logits = head(norm, weight, x.clone().require_grad());
            next_token_loss(logits, targets.clone()).backward();
        })?;
        Ok(Self {
            blocks,
            embedding,
            tail,
        })
    }

    /// The blocks of each of `pp x virtual_stages` stages, balancing these costs; an error
    /// says what to change when there are too few blocks.
    pub fn split(&self, pp: usize, virtual_stages: usize) -> Result<Vec<Range<usize>>, TrainError> {
        let stages = pp * virtual_stages;
        balance(&self.blocks, stages, self.embedding, self.tail).map_err(|_| {
            TrainError::Config(format!(
                "--pp {pp} x --virtual-stages {virtual_stages} needs {stages} stages of at least one block, but the model has {} blocks; lower --pp or --virtual-stages",
                self.blocks.len()
            ))
        })
    }

    /// The same costs on every rank: those of the first rank of every group, broadcast.
    pub(crate) fn shared<B: Backend>(
        self,
        groups: &Groups,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let layers = self.blocks.len();
        let values: Vec<f32> = self
            .blocks
            .iter()
            .chain([&self.embedding, &self.tail])
            .map(|&c| c as f32)
            .collect();
        let mut tensor = Tensor::<B, 1>::from_floats(values.as_slice(), device);
        let tp = groups.tp.as_ref().map(TensorParallel::comm);
        for group in [groups.pp.as_ref(), groups.replicas.as_ref(), tp]
            .into_iter()
            .flatten()
        {
            tensor = group.broadcast(tensor, 0)?;
        }
        let values: Vec<f64> = tensor.into_data().iter::<f32>().map(f64::from).collect();
        Ok(Self {
            blocks: values[..layers].to_vec(),
            embedding: values[layers],
            tail: values[layers + 1],
        })
    }
}

/// The blocks of each of `pp x virtual_stages` stages, balanced by parameter count; an error
/// says what to change when there are too few blocks.
pub fn split(
    config: &LlamaConfig,
    pp: usize,
    virtual_stages: usize,
) -> Result<Vec<Range<usize>>, TrainError> {
    StageCosts::params(config).split(pp, virtual_stages)
}

/// Every stage of the pipeline `pp` on each of its ranks: each rank broadcasts its `trained`
/// stages to the rest (replicas and tensor-parallel peers hold the same stages, so every rank
/// ends with the whole model). `elsewhere` holds the other stages' shapes. Weights travel as
/// f32.
pub(crate) fn share_stages<B: Backend>(
    pp: &Communicator,
    schedule: &Schedule,
    trained: Vec<(usize, Llama<B>)>,
    mut elsewhere: Vec<Option<Llama<B>>>,
) -> Result<Vec<(usize, Llama<B>)>, TrainError> {
    for (s, stage) in trained {
        elsewhere[s] = Some(stage);
    }
    elsewhere
        .into_iter()
        .enumerate()
        .map(|(s, stage)| {
            let stage = stage.expect("every stage is trained here or kept as a shape");
            let mut from_owner = FromOwner {
                comm: pp,
                root: schedule.rank_of(s),
                failed: None,
            };
            let stage = stage.map(&mut from_owner);
            match from_owner.failed {
                None => Ok((s, stage)),
                Some(error) => Err(error.into()),
            }
        })
        .collect()
}

/// Replaces every float parameter by the `root` rank's, in f32.
struct FromOwner<'a> {
    comm: &'a Communicator,
    root: usize,
    /// The first failure; the later parameters are left as they are.
    failed: Option<CommError>,
}

impl<B: Backend> ModuleMapper<B> for FromOwner<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.map(|tensor| {
            if self.failed.is_some() {
                return tensor;
            }
            match self
                .comm
                .broadcast(tensor.clone().cast(DType::F32), self.root)
            {
                Ok(value) => value,
                Err(error) => {
                    self.failed = Some(error);
                    tensor
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn_comm::DeviceMesh;

    #[test]
    fn a_tied_head_costs_its_blocks_and_its_last_stage_the_same_as_an_untied_one() {
        let untied = LlamaConfig::preset("tiny").unwrap();
        let tied = untied.clone().with_tie_word_embeddings(true);
        assert_eq!(StageCosts::params(&tied), StageCosts::params(&untied));
    }

    #[test]
    fn every_rank_gets_the_first_ranks_costs() {
        let results = burn_comm::launch(8, |ctx| {
            let mesh = DeviceMesh::new(ctx.world(), &[("dp", 2), ("pp", 2), ("tp", 2)])?;
            let tp = TensorParallel::new(mesh.group("tp")?.clone());
            let groups = Groups {
                world: Some(ctx.world().clone()),
                pp: Some(mesh.group("pp")?.clone()),
                dp: Some(mesh.group("dp")?.clone()),
                replicas: Some(mesh.group("dp")?.clone()),
                tp: Some(tp),
                ..Groups::default()
            };
            let mine = ctx.rank() as f64;
            let costs = StageCosts {
                blocks: vec![mine + 1.0, 2.0 * mine],
                embedding: mine,
                tail: 3.0 + mine,
            };
            Ok::<_, TrainError>((
                groups.is_first(),
                costs.shared::<Flex>(&groups, &Default::default())?,
            ))
        });
        for (rank, result) in results.into_iter().enumerate() {
            let (first, costs) = result.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(first, rank == 0);
            assert_eq!(costs.blocks, vec![1.0, 0.0], "rank {rank}");
            assert_eq!((costs.embedding, costs.tail), (0.0, 3.0), "rank {rank}");
        }
    }

    #[test]
    fn an_expensive_head_gets_a_stage_with_fewer_blocks() {
        let costs = StageCosts {
            blocks: vec![1.0; 8],
            embedding: 0.0,
            tail: 2.0,
        };
        assert_eq!(costs.split(2, 1).unwrap(), vec![0..5, 5..8]);
        let err = costs.split(3, 3).unwrap_err().to_string();
        assert!(
            err.contains("needs 9 stages") && err.contains("8 blocks"),
            "{err}"
        );
    }
}
