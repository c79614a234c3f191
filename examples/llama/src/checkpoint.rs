//! Training checkpoints through burn-checkpoint: every parameter (fp32) and its AdamW moments
//! under the parameter's path, each rank handing in the blocks it holds; the optimizer's step
//! count and what a resumed run must agree on (the model's shape, the seed, the batch) in the
//! manifest. The data order and the learning rate follow from the step, so a resume in the
//! same layout gives the uninterrupted run's bits; in another layout, each rank reads the
//! blocks it will hold (resharding).

use std::path::PathBuf;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use burn_checkpoint::{Checkpoint, Region, Shard};
use serde_json::{Value, json};

use crate::hf_config::hf_config;
use crate::model::Llama;
use crate::parallel_plan::{ParallelPlan, whole_path};
use crate::train::{TrainConfig, TrainError};
use crate::weights::{Block, Loaded, ParamSource};

/// burn's AdamW's state of a model: each parameter's, by id.
type Records<B> = <OptimizerAdaptor<AdamW, Llama<B>, B> as Optimizer<Llama<B>, B>>::Record;

/// Where and how often a run checkpoints, and whether it resumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// The checkpoints' directory (`step-N/` each, and `latest`).
    pub dir: PathBuf,
    /// Checkpoint after every this many steps; 0: never.
    pub every: usize,
    /// Resume from the newest checkpoint in `dir`, if there is one.
    pub resume: bool,
}

/// A parameter's name in a checkpoint.
fn param_name(path: &str) -> String {
    format!("param/{path}")
}

/// The name of a parameter's first or second AdamW moment.
fn moment_name(which: u8, path: &str) -> String {
    format!("adamw.moment{which}/{path}")
}

/// The box of `block` in its parameter.
fn region(block: &Block<'_>) -> Region {
    match &block.split {
        None => Region::whole(block.whole),
        Some((dim, range)) => Region::block(block.whole, *dim, range.clone()),
    }
}

/// What the manifest keeps of the run beside the tensors.
pub(crate) fn metadata(config: &TrainConfig, adam_steps: usize) -> Value {
    json!({
        "model": hf_config(&config.model),
        "seed": config.seed,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "adamw_steps": adam_steps,
        "layout": crate::dims::ParallelDims::of(config).describe(),
    })
}

/// Fails unless `checkpoint` was taken by a run `config` can continue: the same model, seed
/// and batch (the layout may differ).
pub(crate) fn check_resumable(
    config: &TrainConfig,
    checkpoint: &Checkpoint,
) -> Result<(), TrainError> {
    let stored = checkpoint.metadata();
    let mine = metadata(config, 0);
    for (key, what) in [
        ("model", "model shape"),
        ("seed", "--seed"),
        ("batch_size", "--batch-size"),
        ("seq_len", "--seq-len"),
    ] {
        if stored[key] != mine[key] {
            return Err(TrainError::Config(format!(
                "{} was taken with another {what} ({} there, {} here); resume with the same one, or start afresh in another --checkpoint-dir",
                checkpoint.dir().display(),
                stored[key],
                mine[key]
            )));
        }
    }
    Ok(())
}

/// The optimizer's step count a checkpoint was taken at.
pub(crate) fn adam_steps(checkpoint: &Checkpoint) -> Result<usize, TrainError> {
    checkpoint.metadata()["adamw_steps"]
        .as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| {
            TrainError::Config(format!(
                "{} records no optimizer step count",
                checkpoint.dir().display()
            ))
        })
}

/// The parameters of a checkpoint, as a source of each rank's blocks.
pub struct Resumed(pub Checkpoint);

impl ParamSource for Resumed {
    fn block(&self, block: &Block<'_>) -> Result<Option<Loaded>, String> {
        let data = self
            .0
            .read(&param_name(block.path), &region(block))
            .map_err(|e| e.to_string())?;
        Ok(Some(Loaded {
            data: data.convert::<f32>(),
            transposed: false,
        }))
    }
}

/// Walks a model's parameters with their blocks: the whole model's path, and this rank's box.
struct Walk<'a, F> {
    plan: &'a ParallelPlan,
    first_layer: usize,
    tp: Option<&'a burn_tensor_parallel::TensorParallel>,
    path: Vec<String>,
    each: F,
    failed: Option<TrainError>,
}

impl<'a, F> Walk<'a, F> {
    fn new<B: burn::tensor::backend::Backend>(
        plan: &'a ParallelPlan,
        model: &'a Llama<B>,
        each: F,
    ) -> Self {
        Self {
            plan,
            first_layer: model.part().layers.start,
            tp: model.part().tp.as_ref(),
            path: Vec::new(),
            each,
            failed: None,
        }
    }

    /// The parameter at the current path: its whole path, shape and this rank's box.
    fn block(&self) -> Result<(String, Vec<usize>, Region), TrainError> {
        let local = self.path.join(".");
        let rule = self.plan.rule(&local).ok_or_else(|| {
            TrainError::Config(format!(
                "the parallel plan has no rule for the parameter `{local}`"
            ))
        })?;
        let path = whole_path(&local, self.first_layer);
        let split = rule.block_of(self.tp)?;
        let block = Block {
            path: &path,
            whole: &rule.shape,
            split,
        };
        let region = region(&block);
        Ok((path, rule.shape.clone(), region))
    }
}

/// This rank's pieces of a model trained with burn's AdamW: each parameter's block and its
/// two moments; and the optimizer's step count (the same for every parameter).
pub(crate) fn adamw_pieces<B: AutodiffBackend>(
    plan: &ParallelPlan,
    model: &Llama<B>,
    optimizer: &OptimizerAdaptor<AdamW, Llama<B>, B>,
) -> Result<(Vec<Shard>, usize), TrainError> {
    let records = optimizer.to_record();
    let mut pieces = Vec::new();
    let mut steps = Vec::new();
    let each = |path: String,
                shape: Vec<usize>,
                region: Region,
                value: TensorData,
                state: Option<(usize, TensorData, TensorData)>| {
        let piece = |name: String, data: TensorData| Shard {
            name,
            shape: shape.clone(),
            region: region.clone(),
            data,
        };
        pieces.push(piece(param_name(&path), value));
        match state {
            Some((time, m1, m2)) => {
                steps.push(time);
                pieces.push(piece(moment_name(1, &path), m1));
                pieces.push(piece(moment_name(2, &path), m2));
                Ok(())
            }
            None => Err(TrainError::Config(format!(
                "`{path}` has no optimizer state yet: checkpoints are taken after a step"
            ))),
        }
    };
    struct Collect<'r, B: AutodiffBackend, W> {
        walk: W,
        records: &'r Records<B>,
    }
    impl<B: AutodiffBackend, F> ModuleVisitor<B> for Collect<'_, B, Walk<'_, F>>
    where
        F: FnMut(
            String,
            Vec<usize>,
            Region,
            TensorData,
            Option<(usize, TensorData, TensorData)>,
        ) -> Result<(), TrainError>,
    {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.walk.path.push(name.to_string());
        }

        fn exit_module(&mut self, _: &str, _: &str) {
            self.walk.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.walk.failed.is_some() {
                return;
            }
            let done = self.walk.block().and_then(|(path, shape, region)| {
                let value = param.val().inner().into_data().convert::<f32>();
                let state = self.records.get(&param.id).map(|record| {
                    let state: AdamWState<B::InnerBackend, D> = record.clone().into_state();
                    let momentum = state.momentum;
                    (
                        momentum.time,
                        momentum.moment_1.into_data().convert::<f32>(),
                        momentum.moment_2.into_data().convert::<f32>(),
                    )
                });
                (self.walk.each)(path, shape, region, value, state)
            });
            if let Err(error) = done {
                self.walk.failed = Some(error);
            }
        }
    }
    let mut collect = Collect {
        walk: Walk::new(plan, model, each),
        records: &records,
    };
    model.visit(&mut collect);
    if let Some(error) = collect.walk.failed {
        return Err(error);
    }
    drop(collect);
    steps.sort_unstable();
    steps.dedup();
    match steps.as_slice() {
        [time] => Ok((pieces, *time)),
        _ => Err(TrainError::Config(format!(
            "the parameters were stepped different numbers of times ({steps:?}); a checkpoint holds one step count"
        ))),
    }
}

/// `optimizer` with every parameter's AdamW moments of `model` read from `checkpoint` (this
/// rank's blocks), at the step count it was taken at.
pub(crate) fn load_adamw<B: AutodiffBackend>(
    plan: &ParallelPlan,
    model: &Llama<B>,
    optimizer: OptimizerAdaptor<AdamW, Llama<B>, B>,
    checkpoint: &Checkpoint,
    device: &B::Device,
) -> Result<OptimizerAdaptor<AdamW, Llama<B>, B>, TrainError> {
    let time = adam_steps(checkpoint)?;
    struct Read<'a, B: AutodiffBackend> {
        walk: Walk<'a, ()>,
        checkpoint: &'a Checkpoint,
        time: usize,
        device: &'a B::Device,
        records: Records<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Read<'_, B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.walk.path.push(name.to_string());
        }

        fn exit_module(&mut self, _: &str, _: &str) {
            self.walk.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.walk.failed.is_some() {
                return;
            }
            let read = self.walk.block().and_then(|(path, _, region)| {
                let moment = |which| -> Result<Tensor<B::InnerBackend, D>, TrainError> {
                    let data = self
                        .checkpoint
                        .read(&moment_name(which, &path), &region)
                        .map_err(|e| TrainError::Config(e.to_string()))?;
                    Ok(Tensor::from_data(data.convert::<f32>(), self.device))
                };
                let momentum = AdaptiveMomentumState::new(self.time, moment(1)?, moment(2)?);
                Ok(AdaptorRecord::from_state::<D>(AdamWState { momentum }))
            });
            match read {
                Ok(record) => {
                    self.records.insert(param.id, record);
                }
                Err(error) => self.walk.failed = Some(error),
            }
        }
    }
    let mut read = Read {
        walk: Walk::new(plan, model, ()),
        checkpoint,
        time,
        device,
        records: Records::<B>::default(),
    };
    model.visit(&mut read);
    if let Some(error) = read.walk.failed {
        return Err(error);
    }
    Ok(optimizer.load_record(read.records))
}
