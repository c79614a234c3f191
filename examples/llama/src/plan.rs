//! `llama plan`: model-state bytes per rank at every ZeRO stage (the paper's formulas, from
//! burn-zero), and the activations a micro-batch of the Llama shapes keeps for its backward.
//! Under context parallelism ZeRO shards over dp x cp, and a rank keeps the activations of
//! its tokens only, its ring attention `O(tokens)` instead of the scores' `O(tokens^2)`. A
//! mixture of experts' experts are split over the expert-parallel ranks (and the rest of the
//! model replicated over them), and their activations are those of the top-k experts each
//! token visits.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use burn_tensor_parallel::CpAttention;
use burn_zero::{ModelStateBytes, Precision, ZeroStage, estimate};

use crate::config::LlamaConfig;
use crate::dims::ParallelDims;
use crate::train::{Layout, TrainConfig, TrainError};

/// A layout to size.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Parameters of the whole model.
    pub params: u64,
    /// The model's shape, when it is a preset (for the activations).
    pub model: Option<LlamaConfig>,
    /// Data-parallel ranks (ZeRO shards over them and the context-parallel ones).
    pub dp: usize,
    /// Expert-parallel ranks: each holds `1 / ep` of the experts, and reads its own samples.
    pub ep: usize,
    /// Context-parallel ranks: each holds `seq_len / cp` tokens of every sequence.
    pub cp: usize,
    /// How context-parallel attention reaches the other ranks' keys (with `cp` above 1).
    pub cp_attention: CpAttention,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Sequence parallelism over the tensor-parallel ranks (norms split along the sequence).
    pub sequence_parallel: bool,
    /// Pipeline ranks.
    pub pp: usize,
    /// Element sizes.
    pub precision: Precision,
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sample.
    pub seq_len: usize,
}

impl Plan {
    /// The experts' parameters, of a mixture of experts whose shape is known; the rest of
    /// [`params`](Self::params) is dense.
    pub fn expert_params(&self) -> u64 {
        self.model
            .as_ref()
            .map_or(0, |m| m.num_expert_params() as u64)
    }

    /// Parameters each rank holds before ZeRO: an even share of the dense model over
    /// `tp x pp`, and of the experts over `tp x pp x ep`.
    pub fn params_per_rank(&self) -> u64 {
        let (dense, experts) = self.per_rank();
        dense + experts
    }

    /// The dense and the experts' parameters each rank holds before ZeRO.
    fn per_rank(&self) -> (u64, u64) {
        let split = (self.tp * self.pp) as u64;
        let experts = self.expert_params();
        (
            (self.params - experts).div_ceil(split),
            experts.div_ceil(split * self.ep as u64),
        )
    }

    /// Model-state bytes per rank at `stage`: the dense part sharded over every rank holding
    /// it (dp x ep x cp), the experts over the ranks holding the same ones (dp x cp).
    pub fn model_state(&self, stage: ZeroStage) -> ModelStateBytes {
        let (dense, experts) = self.per_rank();
        let replicas = self.dp * self.cp;
        let dense = estimate(dense, replicas * self.ep, stage, self.precision);
        match experts {
            0 => dense,
            experts => dense + estimate(experts, replicas, stage, self.precision),
        }
    }

    /// Bytes of activations one micro-batch keeps for its backward on the rank with the most
    /// layers, when the model's shape is known (see [`activation_bytes`]).
    pub fn activations(&self) -> Option<u64> {
        let model = self.model.as_ref()?;
        let layers = model.num_hidden_layers.div_ceil(self.pp);
        Some(activation_bytes(
            model,
            self.micro_batch,
            self.seq_len,
            layers,
            TensorSplit {
                ranks: self.tp,
                sequence_parallel: self.sequence_parallel,
            },
            ContextSplit {
                ranks: self.cp,
                attention: self.cp_attention,
            },
            self.precision.param,
        ))
    }

    /// The table `llama plan` prints, in GB (10^9 bytes) per rank.
    pub fn table(&self) -> String {
        let gb = |bytes: usize| bytes as f64 / 1e9;
        let mut out = format!(
            "{:.3e} parameters{}, {:.3e} per rank (dp {}{}{} x tp {} x pp {}); {}-byte parameters and gradients, fp32 Adam moments{}\n\n",
            self.params as f64,
            match self.expert_params() {
                0 => String::new(),
                experts => format!(" ({:.3e} in experts)", experts as f64),
            },
            self.params_per_rank() as f64,
            self.dp,
            if self.ep > 1 {
                format!(" x ep {}", self.ep)
            } else {
                String::new()
            },
            if self.cp > 1 {
                format!(" x cp {}", self.cp)
            } else {
                String::new()
            },
            self.tp,
            self.pp,
            self.precision.param,
            if self.precision.param < 4 {
                " and master weights"
            } else {
                ""
            },
        );
        out += "ZeRO stage   parameters   gradients   optimizer      total   (GB per rank)\n";
        for stage in ZeroStage::ALL {
            let m = self.model_state(stage);
            out += &format!(
                "{:<10} {:>12.3} {:>11.3} {:>11.3} {:>10.3}\n",
                stage.to_string(),
                gb(m.params),
                gb(m.grads),
                gb(m.optimizer),
                gb(m.total()),
            );
        }
        match self.activations() {
            Some(bytes) => {
                out += &format!(
                    "\nactivations kept for backward: {:.3} GB per micro-batch of {} x {} tokens (the first pipeline rank, {} layer(s))\n",
                    gb(bytes as usize),
                    self.micro_batch,
                    self.seq_len / self.cp,
                    self.model
                        .as_ref()
                        .map_or(0, |m| m.num_hidden_layers.div_ceil(self.pp))
                );
            }
            None => out += "\nactivations: give --model for the shapes\n",
        }
        if self.activations().is_some() && self.pp == 1 {
            out += "(under ZeRO-3 burn-zero runs each block's forward again before its backward: a rank keeps one block's activations and the other blocks' inputs, and holds a few units whole; `llama train` counts both)\n";
        }
        if self.ep > 1 {
            out += "(ZeRO with --ep: the experts sharded over dp x cp, the rest over dp x ep x cp; an estimate only, `llama train` does not run it yet)\n";
        }
        out
    }
}

/// What a run of `config` needs in this process, rank by rank, against the memory `available`
/// to it: refused with a sentence when the estimate alone does not fit. The estimate counts
/// the model state and the activations (within a few percent, a pipeline's first chunk's
/// blocks rounded up), not the buffers around them: a run it lets through may still not fit.
pub fn check_memory(
    config: &TrainConfig,
    layout: &Layout,
    available: u64,
) -> Result<(), TrainError> {
    let pipeline = run_bytes(config, layout)?;
    let (here, needed) = in_this_process(config, &pipeline);
    if needed <= available {
        return Ok(());
    }
    let heaviest = heaviest(&pipeline);
    let gb = |bytes: u64| bytes as f64 / 1e9;
    Err(TrainError::Config(format!(
        "this run needs about {:.1} GB of memory on this machine ({here} rank(s); the heaviest keeps {:.2} GB of model state and {:.2} GB of activations for backward, by `llama plan`'s estimate), but {:.1} GB is available; lower --seq-len or --micro-batch-size, or split the work with --tp, --pp, --cp or --zero, or hold it in 16 bits with --dtype bf16",
        gb(needed),
        gb(heaviest.model_state),
        gb(heaviest.activations),
        gb(available),
    )))
}

/// How many ranks of a run of `config` this process holds, and the bytes they need at their
/// peak by the estimate (model state and activations, not the buffers around them).
pub fn process_bytes(config: &TrainConfig, layout: &Layout) -> Result<(usize, u64), TrainError> {
    Ok(in_this_process(config, &run_bytes(config, layout)?))
}

/// [`process_bytes`] from one replica's `pipeline` ([`run_bytes`]).
fn in_this_process(config: &TrainConfig, pipeline: &[RankBytes]) -> (usize, u64) {
    let dims = ParallelDims::of(config);
    let one_pipeline: u64 = pipeline.iter().map(RankBytes::total).sum();
    // Thread ranks share this process, every pipeline rank's peers (dp, ep, cp, tp) alike;
    // under a launcher, this machine's ranks share it, each counted as an average rank.
    match &config.process {
        None => (dims.ranks(), one_pipeline * (dims.ranks() / dims.pp) as u64),
        Some(_) => {
            let local: usize = ["OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"]
                .iter()
                .find_map(|name| std::env::var(name).ok()?.parse().ok())
                .unwrap_or(1);
            (local, one_pipeline * local as u64 / dims.pp as u64)
        }
    }
}

/// A rank's estimated peak: its model state and the activations it keeps at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankBytes {
    pub(crate) model_state: u64,
    pub(crate) activations: u64,
}

impl RankBytes {
    pub(crate) fn total(&self) -> u64 {
        self.model_state.saturating_add(self.activations)
    }
}

/// The rank of a pipeline ([`run_bytes`]) that needs the most.
pub(crate) fn heaviest(pipeline: &[RankBytes]) -> RankBytes {
    *pipeline
        .iter()
        .max_by_key(|rank| rank.total())
        .expect("a pipeline has a rank")
}

/// What every pipeline rank of one replica of `config` keeps at its peak, in pipeline order:
/// its model state (an even share; under ZeRO-3 with the units it holds whole), and its
/// micro-batches' activations, as many as its schedule keeps at once (with recompute, one
/// chunk's and the others' inputs; under ZeRO-3, whose units run their forward again before
/// their backward, one block's and the other blocks' inputs), the head's on the rank holding
/// the last stage.
pub(crate) fn run_bytes(
    config: &TrainConfig,
    layout: &Layout,
) -> Result<Vec<RankBytes>, TrainError> {
    let dims = ParallelDims::of(config);
    let precision = match &config.zero_config.precision {
        Some(_) => Precision::HALF,
        None => Precision::F32,
    };
    let plan = Plan {
        params: config.model.num_params() as u64,
        model: Some(config.model.clone()),
        dp: dims.dp,
        ep: dims.ep,
        cp: dims.cp,
        cp_attention: config.cp_attention,
        tp: dims.tp,
        sequence_parallel: config.sequence_parallel,
        pp: dims.pp,
        precision,
        micro_batch: layout.micro,
        seq_len: config.seq_len,
    };
    let fully_sharded = config.zero == ZeroStage::Parameters && dims.pp == 1;
    let mut model_state = plan.model_state(config.zero).total() as u64;
    if fully_sharded {
        model_state += gathered_units(&config.model, dims.tp, precision.param);
    }
    // ZeRO-1 and 2 all-gather the updated weights while the old ones are still in the replica
    // (burn-zero's `ShardedDataParallel::step`): at the step's end a rank holds them twice.
    let sharded = matches!(
        config.zero,
        ZeroStage::OptimizerState | ZeroStage::Gradients
    );
    if sharded && dims.dp * dims.cp > 1 {
        let (dense, experts) = plan.per_rank();
        model_state += (dense + experts) * precision.param as u64;
    }
    let chunks = dims.pp * config.virtual_stages;
    let activations = |layers| {
        activation_bytes(
            &config.model,
            layout.micro,
            config.seq_len,
            layers,
            TensorSplit {
                ranks: dims.tp,
                sequence_parallel: config.sequence_parallel,
            },
            ContextSplit {
                ranks: dims.cp,
                attention: config.cp_attention,
            },
            precision.param,
        )
    };
    // A micro-batch's head (final norm, logits) and one chunk's blocks.
    let head = activations(0);
    let chunk = activations(config.model.num_hidden_layers.div_ceil(chunks)) - head;
    let one_block = activations(1) - head;
    // How many chunks' activations each pipeline rank keeps at once, and which holds the head.
    let (in_flight, last) = match dims.pp {
        1 => (vec![1], 0),
        pp => in_flight(config.schedule, pp, layout.accum, config.virtual_stages)?,
    };
    let sequence_parts = (dims.cp * if config.sequence_parallel { dims.tp } else { 1 }) as u64;
    let input = (layout.micro * config.seq_len * config.model.hidden_size) as u64 / sequence_parts
        * precision.param as u64;
    Ok(in_flight
        .iter()
        .enumerate()
        .map(|(rank, &kept)| {
            let blocks = match config.recompute {
                // burn-zero's stage 3 runs each unit (one block) untracked, keeping its input,
                // and again before its backward; the last unit (block and head) runs once.
                false if fully_sharded => {
                    one_block + input * config.model.num_hidden_layers.saturating_sub(2) as u64
                }
                false => chunk * kept,
                true => chunk + input * kept,
            };
            // Under recompute the head's are live for one micro-batch's backward at a time.
            let heads = if config.recompute { 1 } else { kept };
            let head = if rank == last { head * heads } else { 0 };
            RankBytes {
                model_state,
                activations: blocks + head,
            }
        })
        .collect())
}

/// What burn-zero's stage 3 holds whole beside its shards, per rank: the unit it computes and
/// the next (prefetched) gathered, and the unit's gradients with their flattened copy before
/// the reduce-scatter: four of its largest unit (a block with the embedding or the head); one
/// more with a tied head, whose unit gathers the embedding's too.
fn gathered_units(model: &LlamaConfig, tp: usize, param_bytes: usize) -> u64 {
    let (v, h) = (model.vocab_size, model.hidden_size);
    let tied = model.tie_word_embeddings;
    let ends = v * h * if tied { 1 } else { 2 } + h;
    let block = (model.num_params() - ends) / model.num_hidden_layers.max(1);
    let unit = ((block + v * h) * param_bytes / tp) as u64;
    unit * if tied { 5 } else { 4 }
}

/// How many chunks' activations each rank of a pipeline schedule keeps at once, and the rank
/// of its last stage, from burn-pipeline's simulation; remembered, as the planner's search
/// asks for the same schedules many times.
fn in_flight(
    kind: burn_pipeline::ScheduleKind,
    pp: usize,
    micro_batches: usize,
    virtual_stages: usize,
) -> Result<(Vec<u64>, usize), TrainError> {
    type Peaks = (Vec<u64>, usize);
    type Key = (burn_pipeline::ScheduleKind, usize, usize, usize);
    static SEEN: LazyLock<Mutex<HashMap<Key, Peaks>>> = LazyLock::new(Default::default);
    let key = (kind, pp, micro_batches, virtual_stages);
    if let Some(peaks) = SEEN.lock().expect("a memo, never poisoned").get(&key) {
        return Ok(peaks.clone());
    }
    let schedule = burn_pipeline::Schedule::new(kind, pp, micro_batches, virtual_stages)?;
    let timeline = burn_pipeline::simulate(&schedule, &burn_pipeline::Costs::UNIT)?;
    let peaks: Peaks = (
        timeline
            .peak_activations()
            .iter()
            .map(|&p| p as u64)
            .collect(),
        schedule.rank_of(schedule.stages() - 1),
    );
    SEEN.lock()
        .expect("a memo, never poisoned")
        .insert(key, peaks.clone());
    Ok(peaks)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes: what a CPU run can use; none where it cannot
/// be read.
pub fn available_host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes the backward of `layers` blocks (plus the final norm and head) keeps for
/// `micro_batch x seq_len` tokens on one of `tp` ranks, computing in `compute_bytes`-byte
/// floats (4 or 2) with the norms and softmaxes in fp32, as the model does.
///
/// Counted from what burn's autodiff saves: a matmul or product keeps each operand whose
/// partner needs a gradient, `exp` and `powi` keep their input, and casts, sums, reshapes and
/// additions keep nothing. Per token and block, each norm keeps its fp32 input, its normed
/// value and its output (the next matmuls' input); attention keeps the rotated queries, the
/// repeated keys and values and the context (4h), the softmax its shifted scores and their
/// exponential in fp32 and the probabilities (3 a s); the MLP keeps the gate, its sigmoid and
/// SiLU, the up projection and the product (5f). The head keeps the final norm's three and
/// the fp32 logits. Without sequence parallelism the norms and the head's input are whole on
/// every tensor-parallel rank; with it each norm keeps its fp32 input and normed value for
/// this rank's `1 / tp` of the tokens, and the next matmuls keep the output gathered whole
/// (`p h`, per rank: the local transport's threads share one gathered buffer, so a process of
/// thread ranks holds less).
///
/// A mixture of experts keeps, per token and block, in place of the MLP: the router's
/// softmax (its fp32 shifted logits, their exponential and the probabilities, `3 E`), the
/// top-k weights and their sum before renormalising (`k + 1` fp32) and in the compute dtype
/// (`k`), the z-loss's fp32 exponential and two per token when it is on (`E + 2`), and for each
/// of its `k` copies the row sent to its expert and the row coming back (weighted: `2 h`),
/// the expert's SwiGLU (`5 f`, split over `tp` with the experts) and the six int32 indices by
/// which it is gathered, sent, run and scattered back. With expert
/// parallelism a rank keeps this for the copies its experts receive: on average its own
/// tokens' count.
///
/// Split over `cp` context-parallel ranks, a rank keeps this for its `seq_len / cp` tokens.
/// By the ring, attention keeps no scores: its backward recomputes them from the rotated queries
/// and keys, the values, the context and each query's fp32 log-sum-exp (`3h + 2 h_kv` and `a`
/// fp32), besides the context the output projection keeps. By all-gather, it keeps its queries
/// and context, every token's keys and values repeated for the query heads (`2h` per token of
/// the sequence, so `2h cp` per own token) and its queries' scores against every key.
/// Not counted: key/value heads copied on several tensor-parallel ranks (fewer heads than
/// ranks), whose share is counted as if split.
pub fn activation_bytes(
    model: &LlamaConfig,
    micro_batch: usize,
    seq_len: usize,
    layers: usize,
    tensor: TensorSplit,
    context: ContextSplit,
    compute_bytes: usize,
) -> u64 {
    const FP32: u64 = 4;
    let (h, f, v, a) = (
        model.hidden_size as u64,
        model.intermediate_size as u64,
        model.vocab_size as u64,
        model.num_attention_heads as u64,
    );
    let kv = (model.num_key_value_heads * model.head_dim()) as u64;
    let (tp, p) = (tensor.ranks.max(1) as u64, compute_bytes as u64);
    let cp = context.ranks.max(1) as u64;
    // This rank's tokens, and the keys each of them attends to.
    let (s, keys) = (seq_len as u64 / cp, seq_len as u64);
    // A norm's fp32 input and normed value, and its output as the next matmuls keep it.
    let norm = match tensor.sequence_parallel && tp > 1 {
        false => (FP32 + 2 * p) * h,
        true => (FP32 + p) * h / tp + p * h,
    };
    let scores = (2 * FP32 + p) * a * keys;
    let attention = match (cp, context.attention) {
        (1, _) => 4 * p * h + scores,
        (_, CpAttention::Ring) => p * (3 * h + 2 * kv) + FP32 * a,
        (cp, CpAttention::AllGather) => p * (2 * h + 2 * h * cp) + scores,
    };
    let per_block = match model.is_moe() {
        false => 2 * norm + (attention + 5 * p * f) / tp,
        true => {
            let (e, k) = (
                model.num_local_experts as u64,
                model.num_experts_per_tok as u64,
            );
            let z_loss = if model.router_z_loss_coef > 0.0 {
                FP32 * (e + 2)
            } else {
                0
            };
            // The copies' int32 indices the selects and scatters keep (six per copy).
            let indices = 6 * k * 4;
            let router = FP32 * (3 * e + k + 1) + p * k + z_loss + indices;
            2 * norm + attention / tp + router + k * (2 * p * h + 5 * p * f / tp)
        }
    };
    let head = norm + FP32 * v / tp;
    micro_batch as u64 * s * (layers as u64 * per_block + head)
}

/// How a block is split for [`activation_bytes`]: over `ranks` tensor-parallel ranks, with
/// sequence parallelism or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSplit {
    /// Tensor-parallel ranks.
    pub ranks: usize,
    /// The norms and the residual stream split along the sequence.
    pub sequence_parallel: bool,
}

impl TensorSplit {
    /// One rank holds every block whole.
    pub const WHOLE: Self = Self {
        ranks: 1,
        sequence_parallel: false,
    };
}

/// How the sequence is split for [`activation_bytes`]: over `ranks` context-parallel ranks
/// (1: not split), their attention by `attention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextSplit {
    /// Context-parallel ranks.
    pub ranks: usize,
    /// How attention reaches the other ranks' keys.
    pub attention: CpAttention,
}

impl ContextSplit {
    /// One rank holds the whole sequence.
    pub const WHOLE: Self = Self {
        ranks: 1,
        attention: CpAttention::Ring,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan of `params` parameters of `model` on 2 data-parallel ranks, otherwise unsplit,
    /// in fp32, for one sample of `seq_len` tokens.
    fn plan(params: u64, model: Option<LlamaConfig>, seq_len: usize) -> Plan {
        Plan {
            params,
            model,
            dp: 2,
            ep: 1,
            cp: 1,
            cp_attention: CpAttention::Ring,
            tp: 1,
            sequence_parallel: false,
            pp: 1,
            precision: Precision::F32,
            micro_batch: 1,
            seq_len,
        }
    }

    #[test]
    fn a_7b_model_on_64_ranks_is_the_papers_table() {
        let plan = Plan {
            dp: 64,
            precision: Precision::HALF,
            ..plan(7_500_000_000, None, 2048)
        };
        let totals: Vec<f64> = ZeroStage::ALL
            .iter()
            .map(|&s| plan.model_state(s).total() as f64 / 1e9)
            .collect();
        for (got, paper) in totals.iter().zip([120.0, 31.4, 16.6, 1.88]) {
            assert!((got - paper).abs() / paper < 0.01, "{totals:?}");
        }
        let table = plan.table();
        assert!(
            table.contains("0 (DDP)") && table.contains("120.000"),
            "{table}"
        );
    }

    #[test]
    fn tensor_and_pipeline_ranks_divide_what_each_rank_holds() {
        let mut plan = Plan {
            micro_batch: 2,
            ..plan(1000, LlamaConfig::preset("tiny"), 32)
        };
        let whole = (
            plan.model_state(ZeroStage::Replicated),
            plan.activations().unwrap(),
        );
        plan.tp = 2;
        plan.pp = 2;
        assert_eq!(
            plan.model_state(ZeroStage::Replicated).total(),
            whole.0.total() / 4
        );
        assert!(plan.activations().unwrap() < whole.1);
    }

    #[test]
    fn context_parallel_ranks_shard_zero_and_keep_their_tokens_activations() {
        let mut plan = plan(1_000_000, LlamaConfig::preset("small"), 1024);
        let (optimizer, activations) = (
            plan.model_state(ZeroStage::OptimizerState).optimizer,
            plan.activations().unwrap(),
        );
        plan.cp = 2;
        // ZeRO shards over dp x cp: the optimizer state halves again.
        assert_eq!(
            plan.model_state(ZeroStage::OptimizerState).optimizer,
            optimizer / 2
        );
        // Half the tokens, and no scores: well under half.
        assert!(plan.activations().unwrap() < activations / 2);
        assert!(plan.table().contains("dp 2 x cp 2"), "{}", plan.table());
    }

    #[test]
    fn expert_parallel_ranks_share_the_experts_and_shard_them_over_fewer_ranks() {
        let model = LlamaConfig::preset("small-moe").unwrap();
        let mut plan = plan(model.num_params() as u64, Some(model.clone()), 256);
        let experts = plan.expert_params();
        assert_eq!(experts, 8 * 3 * 512 * 352 * 8);
        let dense = plan.params - experts;
        plan.ep = 4;
        assert_eq!(plan.params_per_rank(), dense + experts / 4);
        // ZeRO-1's optimizer state (8 bytes per parameter in fp32): the dense part over the 8
        // ranks holding it, each expert over its 2.
        let optimizer = plan.model_state(ZeroStage::OptimizerState).optimizer as u64;
        assert_eq!(optimizer, 8 * dense / 8 + 8 * (experts / 4) / 2);
        let table = plan.table();
        assert!(
            table.contains("in experts") && table.contains("dp 2 x ep 4"),
            "{table}"
        );
    }

    #[test]
    fn a_runs_estimate_keeps_as_many_micro_batches_as_its_schedule() {
        let mut config = TrainConfig::new(LlamaConfig::preset("tiny").unwrap(), 1);
        (config.pp, config.grad_accum) = (2, Some(4));
        let layout = config.layout().unwrap();
        let activations = |layers| {
            activation_bytes(
                &config.model,
                2,
                64,
                layers,
                TensorSplit::WHOLE,
                ContextSplit::WHOLE,
                4,
            )
        };
        let (head, chunk) = (activations(0), activations(2) - activations(0));
        let kept = |config: &TrainConfig| -> Vec<u64> {
            run_bytes(config, &layout)
                .unwrap()
                .iter()
                .map(|r| r.activations)
                .collect()
        };
        // 1F1B's first rank keeps pp micro-batches, its last one and the head's; GPipe's every
        // rank all of them.
        assert_eq!(kept(&config), [2 * chunk, chunk + head]);
        config.schedule = burn_pipeline::ScheduleKind::Gpipe;
        assert_eq!(kept(&config), [4 * chunk, 4 * (chunk + head)]);
        // With recompute, one chunk's and the inputs of the others.
        config.recompute = true;
        let input = 2 * 64 * 128 * 4;
        assert_eq!(kept(&config), [chunk + 4 * input, chunk + 4 * input + head]);
        // Refused below the estimate (both pipeline ranks), with its figures; let through at it.
        let needed: u64 = run_bytes(&config, &layout)
            .unwrap()
            .iter()
            .map(RankBytes::total)
            .sum();
        let error = check_memory(&config, &layout, needed - 1)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("2 rank(s); the heaviest") && error.contains("GB is available"),
            "{error}"
        );
        check_memory(&config, &layout, needed).unwrap();
    }
}
