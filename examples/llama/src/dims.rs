//! The parallel dimensions of a run and the one place that builds its device mesh and groups.

use burn_comm::{Communicator, DeviceMesh};
use burn_tensor_parallel::{ContextParallel, TensorParallel};

use burn_zero::ZeroStage;

use crate::engine::CHECKPOINTED_LAYOUTS;
use crate::parallel_plan::check_split;
use crate::pipeline::Balance;
use crate::train::{Strategy, TrainConfig, TrainError};

/// How many ranks each parallel dimension has. Ranks are laid out `dp x pp x cp x tp`, tp
/// fastest: the tensor-parallel peers are neighbours, then the context-parallel ones, then the
/// stages of a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Pipeline stages per replica.
    pub pp: usize,
    /// Context-parallel ranks per stage: each holds a part of every sequence.
    pub cp: usize,
    /// Tensor-parallel ranks per stage (and part of the sequence, under sequence parallelism).
    pub tp: usize,
}

impl ParallelDims {
    /// The dimensions `config` asks for.
    pub fn of(config: &TrainConfig) -> Self {
        Self {
            dp: config.dp,
            pp: config.pp,
            cp: config.cp,
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
        if self.cp > 1 {
            if config.strategy != Strategy::Ddp {
                return Err(TrainError::Config(
                    "--cp splits every sequence, so the context-parallel ranks average their gradients as data-parallel ones do; use --strategy ddp (the default with --cp)".into(),
                ));
            }
            let chunks = 2 * self.cp;
            if !config.seq_len.is_multiple_of(chunks) {
                return Err(TrainError::Config(format!(
                    "--cp {} cuts each sequence into {chunks} chunks (two per rank, for an even share of the causal mask), but --seq-len {} does not divide by {chunks}; choose a --seq-len that is a multiple of {chunks}",
                    self.cp, config.seq_len
                )));
            }
            let local = config.seq_len / self.cp;
            if config.sequence_parallel && !local.is_multiple_of(self.tp) {
                let multiple = self.cp
                    * if self.tp.is_multiple_of(2) {
                        self.tp
                    } else {
                        2 * self.tp
                    };
                return Err(TrainError::Config(format!(
                    "with --cp {} each rank holds {local} tokens of a sequence, which --sp splits over the {} tensor-parallel ranks, but {local} does not divide by {}; choose a --seq-len that is a multiple of {multiple}",
                    self.cp, self.tp, self.tp
                )));
            }
        }
        // Under context parallelism the tensor-parallel ranks split this rank's tokens.
        check_split(
            &config.model,
            self.tp,
            config.sequence_parallel,
            config.seq_len / self.cp.max(1),
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
        self.dp * self.pp * self.cp * self.tp
    }

    /// The layout's name for messages: `dp 2 x pp 2 x tp 2`, with `x cp N` before tp when the
    /// sequences are split.
    pub fn describe(&self) -> String {
        match self.cp {
            1 => format!("dp {} x pp {} x tp {}", self.dp, self.pp, self.tp),
            cp => format!("dp {} x pp {} x cp {cp} x tp {}", self.dp, self.pp, self.tp),
        }
    }

    /// Whether `rank` holds the first copy of its stages: the first replica's, and the first of
    /// its context- and tensor-parallel peers.
    pub fn is_first_copy(&self, rank: usize) -> bool {
        let in_stage = self.cp * self.tp;
        rank.is_multiple_of(in_stage) && rank < self.pp * in_stage
    }

    /// This rank's groups over `world`, a communicator of [`ranks`](Self::ranks) ranks.
    pub fn groups(&self, world: &Communicator, config: &TrainConfig) -> Result<Groups, TrainError> {
        // Only the dimensions the run uses are split (each split is a communicator, on NCCL
        // too); the others have one rank, so leaving them out keeps every rank's place.
        let wanted = [
            ("dp", self.dp, config.strategy != Strategy::Single),
            ("pp", self.pp, self.pp > 1),
            ("cp", self.cp, self.cp > 1),
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
        let dp = group("dp")?;
        // The ranks holding the same weights: the same stage and tensor-parallel slice.
        let replicas = match self.cp {
            1 => dp.clone(),
            cp => {
                let rank = world.rank();
                let stage = rank / (cp * self.tp) % self.pp;
                Some(world.split("dp x cp", stage * self.tp + rank % self.tp)?)
            }
        };
        // The ranks computing one stage of one replica together, whose backwards run
        // collectives over them.
        let stage_peers = match (self.cp, self.tp) {
            (1, 1) => None,
            (1, _) => group("tp")?,
            (_, 1) => group("cp")?,
            (cp, tp) => Some(world.split("cp x tp", world.rank() / (cp * tp))?),
        };
        Ok(Groups {
            world: Some(world.clone()),
            dp,
            replicas,
            stage_peers,
            pp: group("pp")?,
            cp: group("cp")?.map(|cp| config.context_parallel(cp)),
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
    /// The data-parallel ranks: one per replica, each reading its own samples.
    pub dp: Option<Communicator>,
    /// Every rank holding this rank's weights, which average their gradients (and share their
    /// ZeRO shards): the data-parallel ranks, times the context-parallel ones (Megatron's
    /// data-parallel group "with context parallel").
    pub replicas: Option<Communicator>,
    /// One rank per stage of this rank's pipeline, in stage order.
    pub pp: Option<Communicator>,
    /// The ranks splitting this rank's sequences.
    pub cp: Option<ContextParallel>,
    /// The ranks splitting this rank's stage of the model (by weights or by sequence): cp x
    /// tp. Their backwards communicate, so they start each backward together (see
    /// burn-pipeline's `PipelineExecutor::with_backward_group`).
    pub stage_peers: Option<Communicator>,
    /// The ranks splitting this rank's weights.
    pub tp: Option<TensorParallel>,
}

impl Groups {
    /// Whether this is the first rank of every group.
    pub fn is_first(&self) -> bool {
        self.dp.as_ref().is_none_or(|dp| dp.rank() == 0)
            && self.pp.as_ref().is_none_or(|pp| pp.rank() == 0)
            && self.cp.as_ref().is_none_or(|cp| cp.rank() == 0)
            && self.tp.as_ref().is_none_or(|tp| tp.rank() == 0)
    }
}
