//! The parallel dimensions of a run and the one place that builds its device mesh and groups.

use burn_comm::{Communicator, DeviceMesh};
use burn_tensor_parallel::TensorParallel;

use burn_zero::ZeroStage;

use crate::engine::CHECKPOINTED_LAYOUTS;
use crate::parallel_plan::check_split;
use crate::pipeline::Balance;
use crate::train::{Strategy, TrainConfig, TrainError};

/// How many ranks each parallel dimension has. Ranks are laid out `dp x pp x tp`, tp fastest:
/// the tensor-parallel peers are neighbours, then the stages of a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Pipeline stages per replica.
    pub pp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
}

impl ParallelDims {
    /// The dimensions `config` asks for.
    pub fn of(config: &TrainConfig) -> Self {
        Self {
            dp: config.dp,
            pp: config.pp,
            tp: config.tp,
        }
    }

    /// Refuses, with a sentence saying what to change, a layout that `config` cannot run:
    /// dimensions and strategies that do not combine, flags that belong to a dimension the run
    /// does not have, and a model that does not split over them.
    pub fn validate(&self, config: &TrainConfig) -> Result<(), TrainError> {
        if config.strategy == Strategy::Single && self.dp != 1 {
            return Err(TrainError::Config(format!(
                "the single-device strategy runs one rank, not --dp {}; choose --strategy ddp or parameter-server",
                self.dp
            )));
        }
        if self.pp > 1 && config.strategy == Strategy::ParameterServer {
            return Err(TrainError::Config(
                "the parameter-server baseline replicates whole models; use --strategy ddp with --pp".into(),
            ));
        }
        let pipeline_only = config.virtual_stages != 1
            || config.recompute
            || config.balance != Balance::Params
            || config.schedule_svg.is_some();
        if self.pp == 1 && pipeline_only {
            return Err(TrainError::Config(
                "--schedule-svg, --virtual-stages, --recompute and --balance belong to pipeline parallelism; use them with --pp 2 or more".into(),
            ));
        }
        if config.sequence_parallel && self.tp == 1 {
            return Err(TrainError::Config(
                "--sp splits sequences over the tensor-parallel ranks; use it with --tp 2 or more"
                    .into(),
            ));
        }
        if config.tp_overlap > 0 && self.tp == 1 {
            return Err(TrainError::Config(
                "--tp-overlap overlaps the tensor-parallel ranks' communication; use it with --tp 2 or more"
                    .into(),
            ));
        }
        check_split(
            &config.model,
            self.tp,
            config.sequence_parallel,
            config.seq_len,
        )
        .map_err(TrainError::Config)?;
        if config.checkpoint.is_some() && config.nccl {
            return Err(TrainError::Config(CHECKPOINTED_LAYOUTS.into()));
        }
        if config.strategy == Strategy::ParameterServer && self.tp > 1 {
            return Err(TrainError::Config(
                "the parameter-server baseline replicates whole models; use --strategy ddp with --tp".into(),
            ));
        }
        if config.zero != ZeroStage::Replicated {
            if config.strategy != Strategy::Ddp {
                return Err(TrainError::Config(format!(
                    "--zero {} shards the data-parallel group's model state; use it with --strategy ddp (the default for --dp 2 or more)",
                    config.zero.number()
                )));
            }
            if self.pp > 1 && config.zero != ZeroStage::OptimizerState {
                return Err(TrainError::Config(format!(
                    "--zero {} with --pp: the pipeline holds each stage's whole gradient until its last micro-batch, so only ZeRO-1 helps there (as in DeepSpeed); use --zero 1",
                    config.zero.number()
                )));
            }
        } else if config.zero_config.precision.is_some() {
            return Err(TrainError::Config(
                "--dtype bf16 and f16 keep fp32 master weights in ZeRO's sharded optimizer; add --zero 1, 2 or 3 (also at --dp 1)".into(),
            ));
        }
        if config.max_grad_norm.is_some()
            && (self.tp > 1 || self.pp > 1 || config.strategy == Strategy::ParameterServer)
        {
            return Err(TrainError::Config(
                "--clip-grad-norm needs the whole gradient's norm on every rank, which this run only has with one device, DDP or ZeRO; drop --tp, --pp or the parameter server to clip".into(),
            ));
        }
        if config.zero_config.offload && config.zero == ZeroStage::Replicated {
            return Err(TrainError::Config(
                "--offload moves ZeRO's sharded optimizer state to host memory; add --zero 1, 2 or 3"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Ranks in all.
    pub fn ranks(&self) -> usize {
        self.dp * self.pp * self.tp
    }

    /// The layout's name for messages: `dp 2 x pp 2 x tp 2`.
    pub fn describe(&self) -> String {
        format!("dp {} x pp {} x tp {}", self.dp, self.pp, self.tp)
    }

    /// Whether `rank` holds the first copy of its stages: the first replica's, and the first of
    /// its tensor-parallel peers.
    pub fn is_first_copy(&self, rank: usize) -> bool {
        rank.is_multiple_of(self.tp) && rank < self.pp * self.tp
    }

    /// This rank's groups over `world`, a communicator of [`ranks`](Self::ranks) ranks.
    pub fn groups(&self, world: &Communicator, config: &TrainConfig) -> Result<Groups, TrainError> {
        // Only the dimensions the run uses are split (each split is a communicator, on NCCL
        // too); the others have one rank, so leaving them out keeps every rank's place.
        let wanted = [
            ("dp", self.dp, config.strategy != Strategy::Single),
            ("pp", self.pp, self.pp > 1),
            ("tp", self.tp, self.tp > 1),
        ];
        let dims: Vec<(&str, usize)> = wanted
            .iter()
            .filter(|(_, _, wanted)| *wanted)
            .map(|&(name, size, _)| (name, size))
            .collect();
        let mesh = match dims.is_empty() {
            true => None,
            false => Some(DeviceMesh::new(world, &dims)?),
        };
        let group = |name: &str| -> Result<Option<Communicator>, TrainError> {
            match &mesh {
                Some(mesh) if dims.iter().any(|(n, _)| *n == name) => {
                    Ok(Some(mesh.group(name)?.clone()))
                }
                _ => Ok(None),
            }
        };
        Ok(Groups {
            world: Some(world.clone()),
            dp: group("dp")?,
            pp: group("pp")?,
            tp: group("tp")?.map(|tp| config.tensor_parallel(&tp)),
        })
    }
}

/// One rank's groups; none where the layout has no such dimension.
#[derive(Clone, Default)]
pub struct Groups {
    /// Every rank of the job: where the ranks agree on what all of them must (an f16
    /// overflow skipping a step).
    pub world: Option<Communicator>,
    /// The replicas of this rank's weights (data parallelism).
    pub dp: Option<Communicator>,
    /// One rank per stage of this rank's pipeline, in stage order.
    pub pp: Option<Communicator>,
    /// The ranks splitting this rank's weights.
    pub tp: Option<TensorParallel>,
}

impl Groups {
    /// Whether this is the first rank of every group.
    pub fn is_first(&self) -> bool {
        self.dp.as_ref().is_none_or(|dp| dp.rank() == 0)
            && self.pp.as_ref().is_none_or(|pp| pp.rank() == 0)
            && self.tp.as_ref().is_none_or(|tp| tp.rank() == 0)
    }
}
