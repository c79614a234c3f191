//! Training checkpoints through burn-checkpoint: every parameter (fp32) and its AdamW moments
//! under the parameter's path, each rank handing in the blocks it holds; the optimizer's step
//! count and what a resumed run must agree on (the model's shape, the seed, the batch) in the
//! manifest. The data order and the learning rate follow from the step, so a resume in the
//! same layout gives the uninterrupted run's bits; in another layout, each rank reads the
//! blocks it will hold (resharding).

use std::path::{Path, PathBuf};

use burn::backend::Flex;

use burn::module::{AutodiffModule, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_checkpoint::{Checkpoint, Region, Shard, ShardData};
use burn_ddp::params::{ParamVisitor, visit_params};
use burn_zero::{LossScaleState, ParamRange, ShardState, StateTensor};
use serde_json::{Value, json};

use crate::hf;
use crate::hf_config::{hf_config, parse_hf_config};
use crate::model::Llama;
use crate::parallel_plan::{ParallelPlan, Slices, whole_path};
use crate::train::{TrainConfig, TrainError};
use crate::weights::{Block, Loaded, ParamSource, Weights};

/// burn's AdamW's state of a module: each parameter's, by id.
type Records<B, M> = <OptimizerAdaptor<AdamW, M, B> as Optimizer<M, B>>::Record;

/// Where and how often a run checkpoints, and whether it resumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// The checkpoints' directory (`step-N/` each, and `latest`).
    pub dir: PathBuf,
    /// Checkpoint after every this many steps; 0: never.
    pub every: usize,
    /// Resume from the newest checkpoint in `dir`, if there is one.
    pub resume: bool,
    /// Keep only this many of the newest checkpoints (none: all).
    pub keep: Option<usize>,
    /// Copy the state to host memory in the step that checkpoints, as a GPU run wants: the
    /// device then holds no old state beside the next step's. Otherwise each piece is read as
    /// it is written: on the host, burn's tensors being values, that is a snapshot the step
    /// does not wait for.
    pub stage_on_host: bool,
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
    let dims = 0..block.whole.len();
    Region::new(
        dims.clone().map(|d| block.range(d).start).collect(),
        dims.map(|d| block.range(d).len()).collect(),
    )
}

/// A rank's part of the training state, as an engine hands it in.
pub(crate) struct TrainingState {
    /// Its pieces: parameters (fp32) and AdamW moments.
    pub pieces: Vec<Shard>,
    /// Optimizer steps taken.
    pub adam_steps: usize,
    /// The loss scaler's state (f16).
    pub loss_scale: Option<LossScaleState>,
}

/// What the manifest keeps of the run beside the tensors.
pub(crate) fn metadata(config: &TrainConfig, state: &TrainingState) -> Value {
    json!({
        "model": hf_config(&config.model),
        "seed": config.seed,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "steps": config.steps,
        "lr": config.lr,
        "warmup_steps": config.warmup_steps,
        "max_grad_norm": config.max_grad_norm,
        "adamw_steps": state.adam_steps,
        "loss_scale": state.loss_scale,
        "layout": crate::dims::ParallelDims::of(config).describe(),
    })
}

/// The loss scaler's state a checkpoint was taken with (f16).
pub(crate) fn loss_scale(checkpoint: &Checkpoint) -> Result<Option<LossScaleState>, TrainError> {
    serde_json::from_value(checkpoint.metadata()["loss_scale"].clone()).map_err(|e| {
        TrainError::Config(format!(
            "{}: its loss scale: {e}",
            checkpoint.dir().display()
        ))
    })
}

/// Fails unless `checkpoint` was taken by a run `config` can continue: the same model, seed,
/// batch and schedule (the layout may differ).
pub(crate) fn check_resumable(
    config: &TrainConfig,
    checkpoint: &Checkpoint,
) -> Result<(), TrainError> {
    let stored = checkpoint.metadata();
    let nothing = TrainingState {
        pieces: Vec::new(),
        adam_steps: 0,
        loss_scale: None,
    };
    let mine = metadata(config, &nothing);
    for (key, what) in [
        ("model", "model shape"),
        ("seed", "--seed"),
        ("batch_size", "--batch-size"),
        ("seq_len", "--seq-len"),
        ("steps", "--steps (the learning-rate schedule spans them)"),
        ("lr", "--lr"),
        ("warmup_steps", "--warmup"),
        ("max_grad_norm", "--clip-grad-norm"),
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

/// Fails unless the run `config` has steps left after `checkpoint`'s.
pub(crate) fn check_steps_left(
    config: &TrainConfig,
    checkpoint: &Checkpoint,
) -> Result<(), TrainError> {
    if checkpoint.step() as usize >= config.steps {
        return Err(TrainError::Config(format!(
            "{} is after step {}, and the run has {} steps: nothing is left to train",
            checkpoint.dir().display(),
            checkpoint.step(),
            config.steps
        )));
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

/// Writes the parameters of the training checkpoint in `from` (a checkpoints' directory, whose
/// newest is taken, or one step's) as `hf::save` does into `out`; returns its step.
pub fn export(from: &Path, out: &Path, max_shard_bytes: u64) -> Result<u64, String> {
    if !from.exists() {
        return Err(format!("{} does not exist", from.display()));
    }
    // Before reading the whole model: a place that cannot be written is known now.
    let probe = out.join(format!(".write-check-{}", std::process::id()));
    std::fs::create_dir_all(out)
        .and_then(|_| std::fs::File::create(&probe))
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| format!("--out {}: {e}; nothing was exported", out.display()))?;
    let checkpoint = if from.join(burn_checkpoint::manifest::MANIFEST).exists() {
        Checkpoint::open(from).map_err(|e| e.to_string())?
    } else {
        Checkpoint::latest(from)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("{} holds no checkpoint", from.display()))?
    };
    let config = parse_hf_config(&checkpoint.metadata()["model"])
        .map_err(|e| format!("{}: its model: {e}", checkpoint.dir().display()))?;
    let step = checkpoint.step();
    let weights = Weights::Resumed(Resumed(checkpoint));
    let model = weights
        .whole::<Flex>(&config, &Default::default())
        .map_err(|e| e.to_string())?;
    hf::save(&model, &config, out, max_shard_bytes)?;
    Ok(step)
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

/// Where a rank's parameters sit in the whole model: the first block of each part it holds and
/// their tensor-parallel group. One part's paths are as its visitor names them; several parts'
/// (a pipeline rank's chunks, ZeRO-3's units) start with the part's index (`1.layers.0...`).
pub(crate) struct Held<'a> {
    plan: &'a ParallelPlan,
    first_layers: Vec<usize>,
    at: Slices<'a>,
    indexed: bool,
}

impl<'a> Held<'a> {
    /// The parameters of `model`, one part.
    pub(crate) fn of<B: burn::tensor::backend::Backend>(
        plan: &'a ParallelPlan,
        model: &'a Llama<B>,
    ) -> Self {
        Self {
            plan,
            first_layers: vec![model.part().layers.start],
            at: model.part().slices(),
            indexed: false,
        }
    }

    /// The parameters of parts starting at `first_layers`, paths led by the part's index.
    pub(crate) fn parts(plan: &'a ParallelPlan, first_layers: Vec<usize>, at: Slices<'a>) -> Self {
        Self {
            plan,
            first_layers,
            at,
            indexed: true,
        }
    }

    /// Whether `path` is a tied head's copy of the embedding (held by a part after the first):
    /// the first part's is the one a checkpoint keeps, the copy equal to it.
    fn is_tied_copy(&self, path: &str) -> bool {
        let (part, local) = match self.indexed {
            false => (0, path),
            true => match path.split_once('.') {
                Some((index, local)) => (index.parse().unwrap_or(0), local),
                None => (0, path),
            },
        };
        local == "embed_tokens" && self.first_layers.get(part).is_some_and(|&first| first > 0)
    }

    /// The parameter at `path`: its path in the whole model, its whole shape and this rank's box.
    fn block(&self, path: &str) -> Result<(String, Vec<usize>, Region), TrainError> {
        let (part, local) = match self.indexed {
            false => (0, path),
            true => {
                let (index, local) = path.split_once('.').unwrap_or(("", path));
                let part: usize = index.parse().map_err(|_| {
                    TrainError::Config(format!("`{path}` does not start with its part's index"))
                })?;
                (part, local)
            }
        };
        let first = self.first_layers.get(part).ok_or_else(|| {
            TrainError::Config(format!(
                "`{path}` names part {part}, which this rank does not hold"
            ))
        })?;
        held_block(self.plan, local, *first, self.at)
    }
}

/// The parameter at `local` in a part whose blocks start at `first_layer`, held at `at`: its
/// path in the whole model, its whole shape, and this rank's box of it.
fn held_block(
    plan: &ParallelPlan,
    local: &str,
    first_layer: usize,
    at: Slices<'_>,
) -> Result<(String, Vec<usize>, Region), TrainError> {
    let rule = plan.rule(local).ok_or_else(|| {
        TrainError::Config(format!(
            "the parallel plan has no rule for the parameter `{local}`"
        ))
    })?;
    let path = whole_path(local, first_layer);
    let split = rule.block_of(at)?;
    let block = Block {
        path: &path,
        whole: &rule.shape,
        split,
    };
    let region = region(&block);
    Ok((path, rule.shape.clone(), region))
}

/// The boxes of the whole parameter that elements `range` (row-major) of this rank's block of
/// it cover, in order; and the parameter's path and whole shape.
fn range_boxes(
    held: &Held<'_>,
    range: &ParamRange,
) -> Result<(String, Vec<usize>, Vec<Region>), TrainError> {
    let (path, whole, block) = held.block(&range.name)?;
    let boxes = Region::from_flat(&block.extents, range.range.clone())
        .into_iter()
        .map(|mut b| {
            for (offset, base) in b.offsets.iter_mut().zip(&block.offsets) {
                *offset += base;
            }
            b
        })
        .collect();
    Ok((path, whole, boxes))
}

/// A ZeRO engine's shard state as checkpoint pieces: each range cut into boxes of its whole
/// parameter, each box a view of the state's tensors (on the device, or in host memory where
/// the optimizer is offloaded), read when the piece is written: cutting them copies nothing.
pub(crate) fn zero_pieces<B: Backend>(
    held: &Held<'_>,
    state: ShardState<StateTensor<B>>,
) -> Result<TrainingState, TrainError> {
    let ShardState {
        ranges,
        weights,
        moments,
        steps,
        loss_scale,
    } = state;
    let moments: [Vec<StateTensor<B>>; 2] = match moments {
        Some(moments) => moments,
        // No step has been applied yet (f16 skipped them all): AdamW starts from zeros.
        None => [0, 1].map(|_| weights.iter().map(StateTensor::host_zeros_like).collect()),
    };
    let [first, second] = moments;
    let mut pieces = Vec::new();
    for (((range, weights), first), second) in ranges.iter().zip(weights).zip(first).zip(second) {
        if held.is_tied_copy(&range.name) {
            continue;
        }
        let (path, whole, boxes) = range_boxes(held, range)?;
        let values = [
            (param_name(&path), weights),
            (moment_name(1, &path), first),
            (moment_name(2, &path), second),
        ];
        for (name, flat) in values {
            let mut at = 0;
            for b in &boxes {
                let n = b.volume();
                let part = match flat.clone().narrow(at, n) {
                    StateTensor::Device(t) => ShardData::read_later(t.cast(FloatDType::F32)),
                    StateTensor::Host(t) => ShardData::read_later(t.cast(FloatDType::F32)),
                };
                pieces.push(shard(
                    name.clone(),
                    &whole,
                    b,
                    part.reshaped(b.extents.clone()),
                ));
                at += n;
            }
        }
    }
    Ok(TrainingState {
        pieces,
        adam_steps: steps,
        loss_scale,
    })
}

/// Piece `region` of the parameter `name` of shape `whole`.
fn shard(name: String, whole: &[usize], region: &Region, data: impl Into<ShardData>) -> Shard {
    Shard {
        name,
        shape: whole.to_vec(),
        region: region.clone(),
        data: data.into(),
    }
}

/// A ZeRO engine's moments for `ranges` (see [`zero_pieces`]) read from `checkpoint`, none
/// when it was taken before any step.
pub(crate) fn zero_moments(
    held: &Held<'_>,
    ranges: &[ParamRange],
    checkpoint: &Checkpoint,
) -> Result<Option<[Vec<TensorData>; 2]>, TrainError> {
    if adam_steps(checkpoint)? == 0 {
        return Ok(None);
    }
    let mut moments = [Vec::new(), Vec::new()];
    for range in ranges {
        let (path, _, boxes) = range_boxes(held, range)?;
        for (which, out) in [1, 2].into_iter().zip(moments.iter_mut()) {
            let mut flat = Vec::with_capacity(range.range.len());
            for b in &boxes {
                let data = checkpoint
                    .read(&moment_name(which, &path), b)
                    .map_err(|e| TrainError::Config(e.to_string()))?;
                flat.extend(data.convert::<f32>().to_vec::<f32>().expect("f32 values"));
            }
            let n = flat.len();
            out.push(TensorData::new(flat, [n]));
        }
    }
    Ok(Some(moments))
}

/// This rank's pieces of a model trained with burn's AdamW: each parameter's block and its
/// two moments; and the optimizer's step count (the same for every parameter).
pub(crate) fn adamw_pieces<B: AutodiffBackend, M: AutodiffModule<B>>(
    held: &Held<'_>,
    model: &M,
    optimizer: &OptimizerAdaptor<AdamW, M, B>,
) -> Result<TrainingState, TrainError> {
    struct Collect<'a, B: AutodiffBackend, M: AutodiffModule<B>> {
        held: &'a Held<'a>,
        records: Records<B, M>,
        pieces: Vec<Shard>,
        steps: Vec<usize>,
        failed: Option<TrainError>,
    }
    impl<B: AutodiffBackend, M: AutodiffModule<B>> Collect<'_, B, M> {
        fn add<const D: usize>(
            &mut self,
            local: &str,
            param: &Param<Tensor<B, D>>,
        ) -> Result<(), TrainError> {
            if self.held.is_tied_copy(local) {
                return Ok(());
            }
            let (path, shape, region) = self.held.block(local)?;
            let record = self.records.get(&param.id).ok_or_else(|| {
                TrainError::Config(format!(
                    "`{path}` has no optimizer state yet: checkpoints are taken after a step"
                ))
            })?;
            let state: AdamWState<B::InnerBackend, D> = record.clone().into_state();
            let momentum = state.momentum;
            if momentum.max_moment_2.is_some() {
                return Err(TrainError::Config(format!(
                    "`{path}` has AMSGrad's maximum moment, which checkpoints do not keep"
                )));
            }
            self.steps.push(momentum.time);
            let values = [
                (param_name(&path), param.val().inner()),
                (moment_name(1, &path), momentum.moment_1),
                (moment_name(2, &path), momentum.moment_2),
            ];
            for (name, tensor) in values {
                let data = ShardData::read_later(tensor.cast(FloatDType::F32));
                self.pieces.push(shard(name, &shape, &region, data));
            }
            Ok(())
        }
    }
    impl<B: AutodiffBackend, M: AutodiffModule<B>> ParamVisitor<B> for Collect<'_, B, M> {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            if self.failed.is_none()
                && let Err(error) = self.add(path, param)
            {
                self.failed = Some(error);
            }
        }
    }
    let mut collect = Collect::<B, M> {
        held,
        records: optimizer.to_record(),
        pieces: Vec::new(),
        steps: Vec::new(),
        failed: None,
    };
    visit_params(model, &mut collect);
    if let Some(error) = collect.failed {
        return Err(error);
    }
    let mut steps = collect.steps;
    steps.sort_unstable();
    steps.dedup();
    match steps.as_slice() {
        [time] => Ok(TrainingState {
            pieces: collect.pieces,
            adam_steps: *time,
            loss_scale: None,
        }),
        _ => Err(TrainError::Config(format!(
            "the parameters were stepped different numbers of times ({steps:?}); a checkpoint holds one step count"
        ))),
    }
}

/// `optimizer` with every parameter's AdamW moments of `model` read from `checkpoint` (this
/// rank's blocks), at the step count it was taken at.
pub(crate) fn load_adamw<B: AutodiffBackend, M: AutodiffModule<B>>(
    held: &Held<'_>,
    model: &M,
    optimizer: OptimizerAdaptor<AdamW, M, B>,
    checkpoint: &Checkpoint,
    device: &B::Device,
) -> Result<OptimizerAdaptor<AdamW, M, B>, TrainError> {
    struct Read<'a, B: AutodiffBackend, M: AutodiffModule<B>> {
        held: &'a Held<'a>,
        checkpoint: &'a Checkpoint,
        time: usize,
        device: &'a B::Device,
        records: Records<B, M>,
        failed: Option<TrainError>,
    }
    impl<B: AutodiffBackend, M: AutodiffModule<B>> Read<'_, B, M> {
        fn moment<const D: usize>(
            &self,
            which: u8,
            path: &str,
            region: &Region,
        ) -> Result<Tensor<B::InnerBackend, D>, TrainError> {
            let data = self
                .checkpoint
                .read(&moment_name(which, path), region)
                .map_err(|e| TrainError::Config(e.to_string()))?;
            Ok(Tensor::from_data(data.convert::<f32>(), self.device))
        }
    }
    impl<B: AutodiffBackend, M: AutodiffModule<B>> ParamVisitor<B> for Read<'_, B, M> {
        fn visit<const D: usize>(&mut self, local: &str, param: &Param<Tensor<B, D>>) {
            if self.failed.is_some() {
                return;
            }
            let read = self.held.block(local).and_then(|(path, _, region)| {
                let (first, second) = (
                    self.moment(1, &path, &region)?,
                    self.moment(2, &path, &region)?,
                );
                let momentum = AdaptiveMomentumState::new(self.time, first, second);
                Ok(AdaptorRecord::from_state::<D>(AdamWState { momentum }))
            });
            match read {
                Ok(record) => {
                    self.records.insert(param.id, record);
                }
                Err(error) => self.failed = Some(error),
            }
        }
    }
    let mut read = Read::<B, M> {
        held,
        checkpoint,
        time: adam_steps(checkpoint)?,
        device,
        records: Records::<B, M>::default(),
        failed: None,
    };
    visit_params(model, &mut read);
    if let Some(error) = read.failed {
        return Err(error);
    }
    Ok(optimizer.load_record(read.records))
}
