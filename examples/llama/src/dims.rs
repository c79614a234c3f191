//! The parallel dimensions of a run and the one place that builds its device mesh and groups.

use burn_comm::{Communicator, DeviceMesh};
use burn_expert_parallel::ExpertParallel;
use burn_tensor_parallel::{ContextParallel, TensorParallel};

use burn_zero::ZeroStage;

use crate::experts::{MoeRecord, PartExperts};
use crate::model::Llama;
use crate::parallel_plan::{Slices, check_split};
use crate::pipeline::Balance;
use crate::train::{Strategy, TrainConfig, TrainError};

/// How many ranks each parallel dimension has. Ranks are laid out `dp x ep x pp x cp x tp`,
/// tp fastest: the tensor-parallel peers are neighbours, then the context-parallel ones, then
/// the stages of a pipeline, then the expert-parallel ranks, which are data-parallel too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    /// Data-parallel replicas of each expert: with expert parallelism, `dp x ep` ranks read
    /// their own samples (Megatron's data-parallel size), `dp` of them holding each expert
    /// (its expert-data-parallel size).
    pub dp: usize,
    /// Expert-parallel ranks: each holds `experts / ep` of every mixture of experts' experts
    /// and reads its own samples, whose tokens travel to their experts' ranks and back.
    pub ep: usize,
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
            ep: config.ep,
            pp: config.pp,
            cp: config.cp,
            tp: config.tp,
        }
    }

    /// Ranks each reading their own samples: `dp x ep`.
    pub fn data_ranks(&self) -> usize {
        self.dp * self.ep
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
            && (self.tp > 1
                || self.pp > 1
                || self.ep > 1
                || config.strategy == Strategy::ParameterServer)
        {
            return Err(TrainError::Config(
                "--clip-grad-norm needs the whole gradient's norm on every rank, which this run only has with one device, DDP or ZeRO; drop --tp, --pp, --ep or the parameter server to clip".into(),
            ));
        }
        self.validate_experts(config)?;
        if config.zero_config.offload && config.zero == ZeroStage::Replicated {
            return Err(TrainError::Config(
                "--offload moves ZeRO's sharded optimizer state to host memory; add --zero 1, 2 or 3"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Refuses what a mixture of experts or expert parallelism cannot run with.
    fn validate_experts(&self, config: &TrainConfig) -> Result<(), TrainError> {
        let model = &config.model;
        if model.is_moe() && config.sequence_parallel {
            return Err(TrainError::Config(
                "--sp splits a block's tokens over the tensor-parallel ranks, but their mixture of experts splits each expert over them, which needs every rank to hold the same tokens; drop --sp (tensor parallelism without it splits the experts)".into(),
            ));
        }
        if self.ep == 1 {
            return Ok(());
        }
        if !model.is_moe() {
            return Err(TrainError::Config(format!(
                "--ep {} splits a mixture of experts' experts over ranks, but this model has none; use --model tiny-moe or small-moe (or a config with num_local_experts)",
                self.ep
            )));
        }
        let experts = model.num_local_experts;
        if !experts.is_multiple_of(self.ep) {
            return Err(TrainError::Config(format!(
                "--ep {} does not divide the {experts} experts of each block; choose --ep among {}",
                self.ep,
                burn_tensor_parallel::group::divisors(experts)
            )));
        }
        if config.strategy != Strategy::Ddp {
            return Err(TrainError::Config(
                "--ep makes every expert-parallel rank read its own samples, as data parallelism does; use --strategy ddp (the default with --ep)".into(),
            ));
        }
        if config.zero != ZeroStage::Replicated {
            return Err(TrainError::Config(format!(
                "--zero {} shards the model state over one data-parallel group, but under --ep each expert is held by its dp ranks only; drop --zero (ZeRO with expert parallelism is not built yet)",
                config.zero.number()
            )));
        }
        Ok(())
    }

    /// Ranks in all.
    pub fn ranks(&self) -> usize {
        self.dp * self.ep * self.pp * self.cp * self.tp
    }

    /// The layout's name for messages: `dp 2 x pp 2 x tp 2`, with `x ep N` after dp when the
    /// experts are split and `x cp N` before tp when the sequences are.
    pub fn describe(&self) -> String {
        let mut name = format!("dp {}", self.dp);
        if self.ep > 1 {
            name += &format!(" x ep {}", self.ep);
        }
        name += &format!(" x pp {}", self.pp);
        if self.cp > 1 {
            name += &format!(" x cp {}", self.cp);
        }
        name + &format!(" x tp {}", self.tp)
    }

    /// Whether `rank` holds the first copy of its stages: the first replica's (and expert
    /// group's), and the first of its context- and tensor-parallel peers.
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
            ("ep", self.ep, self.ep > 1),
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
        let rank = world.rank();
        let (cp, tp) = (self.cp, self.tp);
        let stage = rank / (cp * tp) % self.pp;
        let expert_rank = rank / (self.pp * cp * tp) % self.ep;
        // The ranks reading their own samples: every dp and ep index of this place in a replica.
        let dp = match self.ep {
            1 => group("dp")?,
            _ => Some(world.split("dp x ep", rank % (self.pp * cp * tp))?),
        };
        // The ranks holding the same weights: the same stage and tensor-parallel slice (the same
        // dense weights, under expert parallelism).
        let replicas = match (self.ep, cp) {
            (1, 1) => dp.clone(),
            (1, _) => Some(world.split("dp x cp", stage * tp + rank % tp)?),
            _ => Some(world.split("dp x ep x cp", stage * tp + rank % tp)?),
        };
        // The ranks holding the same experts: the same expert-parallel index too.
        let expert_replicas = match (self.ep, cp) {
            (1, _) => None,
            (_, 1) => group("dp")?,
            _ => Some(world.split("dp x cp", (expert_rank * self.pp + stage) * tp + rank % tp)?),
        };
        // The ranks computing one stage of one replica together, whose backwards run
        // collectives over them (the experts' exchanges too).
        let stage_peers = match (self.ep, cp, tp) {
            (1, 1, 1) => None,
            (1, 1, _) => group("tp")?,
            (1, _, 1) => group("cp")?,
            (1, cp, tp) => Some(world.split("cp x tp", rank / (cp * tp))?),
            (ep, cp, tp) => {
                let data_index = rank / (ep * self.pp * cp * tp);
                Some(world.split("ep x cp x tp", data_index * self.pp + stage)?)
            }
        };
        let groups = Groups {
            world: Some(world.clone()),
            dp,
            replicas,
            stage_peers,
            pp: group("pp")?,
            cp: group("cp")?.map(|cp| config.context_parallel(cp)),
            tp: group("tp")?.map(|tp| config.tensor_parallel(&tp)),
            ep: group("ep")?,
            expert_replicas,
            experts: None,
        };
        groups.with_experts(config)
    }
}

/// One rank's groups; none where the layout has no such dimension.
#[derive(Clone, Default)]
pub struct Groups {
    /// Every rank of the job: where the ranks agree on what all of them must (an f16
    /// overflow skipping a step).
    pub world: Option<Communicator>,
    /// The ranks reading their own samples: one per replica, times the expert-parallel ranks
    /// (dp x ep).
    pub dp: Option<Communicator>,
    /// Every rank holding this rank's (dense) weights, which average their gradients (and
    /// share their ZeRO shards): the data-parallel ranks, times the expert- and
    /// context-parallel ones, dp x ep x cp (Megatron's data-parallel group "with context
    /// parallel"); the ranks a micro-batch is spread over, too.
    pub replicas: Option<Communicator>,
    /// One rank per stage of this rank's pipeline, in stage order.
    pub pp: Option<Communicator>,
    /// The ranks splitting this rank's sequences.
    pub cp: Option<ContextParallel>,
    /// The ranks splitting this rank's stage of the model (by weights, by sequence or by
    /// experts): ep x cp x tp. Their backwards communicate, so they start each backward together (see
    /// burn-pipeline's `PipelineExecutor::with_backward_group`).
    pub stage_peers: Option<Communicator>,
    /// The ranks splitting this rank's weights.
    pub tp: Option<TensorParallel>,
    /// The ranks splitting every mixture of experts' experts; each reads its own samples.
    pub ep: Option<Communicator>,
    /// Every rank holding this rank's experts, which average their gradients (the ranks of
    /// `replicas` with this rank's expert-parallel index: Megatron's expert-data-parallel
    /// group).
    pub expert_replicas: Option<Communicator>,
    /// How this rank's mixtures of experts are split and where they note their figures; none
    /// for a dense model.
    pub experts: Option<PartExperts>,
}

impl Groups {
    /// These groups with their mixtures of experts' split (over `ep`, each expert over `tp`)
    /// when `config`'s model has experts.
    pub fn with_experts(mut self, config: &TrainConfig) -> Result<Self, TrainError> {
        if !config.model.is_moe() {
            return Ok(self);
        }
        let ep = ExpertParallel::new(config.model.num_local_experts, self.ep.clone())
            .map_err(|e| TrainError::Config(e.to_string()))?
            .with_tensor_parallel(self.tp.as_ref().map(|tp| tp.comm().clone()));
        self.experts = Some(PartExperts {
            ep,
            batch: self.replicas.clone(),
            record: MoeRecord::default(),
        });
        Ok(self)
    }

    /// Where this rank sits in the groups the plan splits parameters over.
    pub fn slices(&self) -> Slices<'_> {
        Slices {
            tp: self.tp.as_ref(),
            ep: self.experts.as_ref().map(|experts| &experts.ep),
        }
    }

    /// `part` set up for this rank: computing on its share of each sequence, its mixtures of
    /// experts split and noting their figures.
    pub fn set_up<B: burn::tensor::backend::Backend>(&self, part: Llama<B>) -> Llama<B> {
        part.with_cp(self.cp.clone())
            .with_experts(self.experts.clone())
    }

    /// Whether this is the first rank of every group.
    pub fn is_first(&self) -> bool {
        self.dp.as_ref().is_none_or(|dp| dp.rank() == 0)
            && self.pp.as_ref().is_none_or(|pp| pp.rank() == 0)
            && self.cp.as_ref().is_none_or(|cp| cp.rank() == 0)
            && self.tp.as_ref().is_none_or(|tp| tp.rank() == 0)
    }
}
