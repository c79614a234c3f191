//! Training with burn-train: on one device, or as one rank of a data-parallel group. The lines
//! that differ are marked `data-parallel:`; README.md shows them as a diff.

use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::optim::AdamConfig;
use burn::record::DefaultRecorder;
use burn::tensor::ElementConversion;
use burn::tensor::backend::Backend;
use burn_comm::RankContext;
use burn_parallel_train::{
    BackwardHooks, DataParallelTraining, DistributedDataLoader, per_rank_batch,
};
use burn_train::metric::{AccuracyMetric, LossMetric};
use burn_train::{Learner, SupervisedTraining};

use crate::data::{PointBatch, PointBatcher, spirals};
use crate::model::Classifier;

/// What to train and where to write it.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Where burn-train writes its logs and checkpoints.
    pub dir: PathBuf,
    pub epochs: usize,
    /// Samples per optimizer step, over every rank together.
    pub global_batch: usize,
    pub lr: f64,
    pub width: usize,
    pub train_points: usize,
    pub valid_points: usize,
    pub seed: u64,
    /// Reshuffle the training set every epoch (off: one device and every layout read the same
    /// batches, so their results agree to rounding).
    pub shuffle: bool,
    /// Resume after this epoch from the checkpoint in `dir`.
    pub resume: Option<usize>,
    /// Show burn-train's progress (rank 0 only).
    pub render: bool,
}

impl TrainConfig {
    /// A run that trains in a few seconds on a CPU.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            epochs: 6,
            global_batch: 64,
            lr: 1e-2,
            width: 64,
            train_points: 3072,
            valid_points: 768,
            seed: 42,
            shuffle: true,
            resume: None,
            render: false,
        }
    }
}

/// What a run ends with: the validation loss and accuracy of the trained model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    pub loss: f32,
    pub accuracy: f32,
}

/// Trains `model` with burn-train. `rank` is `None` on one device; under `burn_comm::launch` it
/// is this rank, and the run is data-parallel over every rank with the same global batch.
pub fn train<B: BackwardHooks>(
    config: &TrainConfig,
    model: Classifier<B>,
    device: B::Device,
    rank: Option<&RankContext>,
) -> Result<Evaluation, String> {
    let points = spirals(config.train_points, config.seed);
    let train: Arc<dyn DataLoader<B, PointBatch<B>>> = match rank {
        None => {
            let mut loader = DataLoaderBuilder::new(PointBatcher)
                .batch_size(config.global_batch)
                .set_device(device.clone());
            if config.shuffle {
                loader = loader.shuffle(config.seed);
            }
            loader.build(points)
        }
        // data-parallel: each rank reads its share of every global batch.
        Some(rank) => {
            let batch = per_rank_batch(config.global_batch, rank.world_size())
                .map_err(|e| e.to_string())?;
            let mut loader = DistributedDataLoader::new(PointBatcher, points, batch, rank.world())
                .map_err(|e| e.to_string())?
                .with_device(device.clone());
            if config.shuffle {
                loader = loader.with_shuffle(config.seed);
            }
            loader.into_arc()
        }
    };
    let valid = valid_loader::<B::InnerBackend>(config, &device);

    let mut training = SupervisedTraining::new(&config.dir, train, valid)
        .metrics((LossMetric::new(), AccuracyMetric::new()))
        .with_file_checkpointer(DefaultRecorder::new())
        .num_epochs(config.epochs);
    if !config.render {
        training = training.renderer(burn_parallel_train::QuietRenderer);
    }
    if let Some(epoch) = config.resume {
        training = training.checkpoint(epoch);
    }
    // data-parallel: one line.
    if let Some(rank) = rank {
        training = training.data_parallel(rank.world().clone(), device.clone());
    }

    let optimizer = AdamConfig::new().init();
    let trained = training.launch(Learner::new(model, optimizer, config.lr));
    Ok(evaluate(&trained.model, &valid_loader(config, &device)))
}

fn valid_loader<B: Backend>(
    config: &TrainConfig,
    device: &B::Device,
) -> Arc<dyn DataLoader<B, PointBatch<B>>> {
    DataLoaderBuilder::new(PointBatcher)
        .batch_size(256)
        .set_device(device.clone())
        .build(spirals(config.valid_points, config.seed + 1))
}

/// Mean loss and accuracy over the validation set.
pub fn evaluate<B: Backend>(
    model: &Classifier<B>,
    valid: &Arc<dyn DataLoader<B, PointBatch<B>>>,
) -> Evaluation {
    let (mut loss, mut correct, mut seen) = (0.0, 0, 0);
    for batch in valid.iter() {
        let n = batch.arms.dims()[0];
        let output = model.classify(batch);
        loss += output.loss.into_scalar().elem::<f32>() * n as f32;
        let predicted = output.output.argmax(1).squeeze_dim::<1>(1);
        correct += predicted
            .equal(output.targets)
            .int()
            .sum()
            .into_scalar()
            .elem::<i64>() as usize;
        seen += n;
    }
    Evaluation {
        loss: loss / seen as f32,
        accuracy: correct as f32 / seen as f32,
    }
}
