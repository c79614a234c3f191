//! The model's mixtures of experts: how a part's experts are split over the ranks, and what
//! they report. Each tracked forward of a block notes its experts' figures (copies of this
//! rank's tokens per expert, dropped copies, this rank's shares of the balancing and z losses)
//! and the last part its language-model loss; once a step, [`MoeRecord::step_metrics`] sums
//! them over the job into the step's metrics. A forward done again for a backward (recompute,
//! zero-bubble's weight half, ZeRO-3) runs with its weights tracked only the second time, so
//! each micro-batch is noted once.

use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_comm::{Communicator, ReduceOp};
use burn_expert_parallel::{DispatchStats, ExpertParallel};
use serde::Serialize;

use crate::train::{TrainError, scalar};

/// How a part's experts are split and where its mixtures of experts report.
#[derive(Debug, Clone)]
pub struct PartExperts {
    /// The experts' split over the expert-parallel ranks (and each expert's over the
    /// tensor-parallel ones).
    pub ep: ExpertParallel,
    /// The ranks a micro-batch is spread over, whose balancing loss is the whole batch's.
    pub batch: Option<Communicator>,
    /// Where tracked forwards note their figures.
    pub record: MoeRecord,
}

/// What the tracked forwards of a rank's mixtures of experts noted since the last step.
#[derive(Debug, Clone, Default)]
pub struct MoeRecord(Arc<Mutex<Noted>>);

#[derive(Debug, Default)]
struct Noted {
    /// Per block (its index in the whole model) and micro-batch.
    blocks: Vec<BlockFigures>,
    /// Each micro-batch's language-model loss, on the part holding the head.
    lm_losses: Vec<f64>,
}

#[derive(Debug)]
struct BlockFigures {
    block: usize,
    aux_loss: f64,
    z_loss: f64,
    stats: DispatchStats,
}

/// A step's mixture-of-experts figures over the whole job.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MoeMetrics {
    /// The balancing losses of every block, weighted, over the global batch (the mean over
    /// its micro-batches).
    pub aux_loss: f64,
    /// The router z-losses of every block, weighted, likewise.
    pub z_loss: f64,
    /// Copies of the global batch's tokens the least used expert of any block took.
    pub tokens_per_expert_min: usize,
    /// Copies the most used expert of any block took.
    pub tokens_per_expert_max: usize,
    /// Copies per expert on average (`tokens x top-k / experts` when nothing is dropped).
    pub tokens_per_expert_mean: f64,
    /// Copies dropped over capacity, over every block.
    pub dropped: usize,
    /// Bytes a rank sent its expert-parallel peers in the step (token copies to their experts
    /// and back, forward and backward), the mean over the ranks; 0 without expert parallelism.
    pub exchanged_bytes: f64,
}

/// What a step's record comes to: the language-model loss and the experts' figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeStep {
    /// The mean cross-entropy over the global batch, without the routers' losses.
    pub lm_loss: f64,
    /// The experts' figures.
    pub metrics: MoeMetrics,
}

/// Where this rank's figures count in the job's sums.
#[derive(Debug, Clone, Copy)]
pub struct Counting {
    /// Blocks of the whole model.
    pub blocks: usize,
    /// Experts of each block.
    pub experts: usize,
    /// Ranks each holding other tokens of a micro-batch (data, expert and context parallel).
    pub data_ranks: usize,
    /// Micro-batches per step on each rank.
    pub micro_batches: usize,
    /// Whether this rank's figures count: its tensor-parallel peers note the same ones, so
    /// only the first of them does.
    pub counts: bool,
    /// Ranks of the job.
    pub ranks: usize,
}

impl MoeRecord {
    /// Notes a tracked forward of block `block`.
    pub(crate) fn block<B: Backend>(
        &self,
        block: usize,
        aux_loss: &Tensor<B, 1>,
        z_loss: &Tensor<B, 1>,
        stats: DispatchStats,
    ) {
        let figures = BlockFigures {
            block,
            aux_loss: scalar(aux_loss),
            z_loss: scalar(z_loss),
            stats,
        };
        self.lock().blocks.push(figures);
    }

    /// Notes a tracked forward's language-model loss.
    pub(crate) fn lm_loss(&self, loss: f64) {
        self.lock().lm_losses.push(loss);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Noted> {
        self.0.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// The step's figures over the job (a collective over `world`, when there is one), this
    /// rank having sent `exchanged` bytes to its expert-parallel peers, and the record emptied
    /// for the next.
    pub fn step_metrics<B: Backend>(
        &self,
        counting: Counting,
        exchanged: u64,
        world: Option<&Communicator>,
        device: &B::Device,
    ) -> Result<MoeStep, TrainError> {
        let Counting {
            blocks,
            experts,
            data_ranks,
            micro_batches,
            counts,
            ranks,
        } = counting;
        let noted = std::mem::take(&mut *self.lock());
        // One vector for one all-reduce: per block its experts' copies, then its dropped
        // copies, balancing loss and z-loss; then the language-model loss; last the bytes
        // exchanged, which every rank sends.
        let per_block = experts + 3;
        let mut sums = vec![0f64; blocks * per_block + 2];
        sums[blocks * per_block + 1] = exchanged as f64;
        if counts {
            for figures in &noted.blocks {
                let at = figures.block * per_block;
                for (e, &n) in figures.stats.tokens_per_expert.iter().enumerate() {
                    sums[at + e] += n as f64;
                }
                sums[at + experts] += figures.stats.dropped as f64;
                sums[at + experts + 1] += figures.aux_loss;
                sums[at + experts + 2] += figures.z_loss;
            }
            sums[blocks * per_block] = noted.lm_losses.iter().sum();
        }
        if let Some(world) = world {
            let n = sums.len();
            let local = Tensor::<B, 1>::from_data(TensorData::new(sums, [n]), (device, DType::F64));
            sums = world
                .all_reduce(local, ReduceOp::Sum)?
                .into_data()
                .convert::<f64>()
                .to_vec()
                .expect("an f64 tensor reads as f64");
        }
        // Each rank's losses are its shares of its micro-batches': the mean over the ranks of
        // a micro-batch, then over the micro-batches, is the step's.
        let mean = |sum: f64| sum / (data_ranks * micro_batches) as f64;
        let mut metrics = MoeMetrics {
            aux_loss: 0.0,
            z_loss: 0.0,
            tokens_per_expert_min: usize::MAX,
            tokens_per_expert_max: 0,
            tokens_per_expert_mean: 0.0,
            dropped: 0,
            exchanged_bytes: sums[blocks * per_block + 1] / ranks as f64,
        };
        let mut copies = 0.0;
        for block in sums[..blocks * per_block].chunks(per_block) {
            for &n in &block[..experts] {
                metrics.tokens_per_expert_min = metrics.tokens_per_expert_min.min(n as usize);
                metrics.tokens_per_expert_max = metrics.tokens_per_expert_max.max(n as usize);
                copies += n;
            }
            metrics.dropped += block[experts] as usize;
            metrics.aux_loss += mean(block[experts + 1]);
            metrics.z_loss += mean(block[experts + 2]);
        }
        metrics.tokens_per_expert_mean = copies / (blocks * experts).max(1) as f64;
        if blocks == 0 {
            metrics.tokens_per_expert_min = 0;
        }
        Ok(MoeStep {
            lm_loss: mean(sums[blocks * per_block]),
            metrics,
        })
    }
}
