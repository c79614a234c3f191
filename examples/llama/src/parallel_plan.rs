//! The parallel plan: how each parameter is split over the tensor-parallel group (by its path
//! in the model), which blocks each pipeline stage holds, and ZeRO-3's units. It is data: made
//! from the configuration, checked before anything runs, printed by `llama train
//! --print-plan`, and applied by parameter path to load each rank's part (only its blocks), to
//! cut a whole model and to gather it back (torchtitan's plan over module names).

use std::fmt::Write;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_expert_parallel::ExpertParallel;
use burn_tensor_parallel::TensorParallel;
use burn_tensor_parallel::attention::check_heads;
use burn_tensor_parallel::group::divisors;
use burn_zero::ZeroStage;

use crate::config::LlamaConfig;
use crate::dims::ParallelDims;
use crate::model::Llama;
use crate::pipeline::{Balance, split};
use crate::train::{TrainConfig, TrainError};
use crate::weights::{Block, ParamSource};

/// How one parameter is held by the ranks of a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds it whole (a norm's scale). Under sequence parallelism each rank
    /// applies it to its own part of the sequence, and the group sums its gradient.
    Replicated,
    /// Column-parallel: the output features (`[in, out]`'s columns) split over the group.
    /// With fewer blocks than ranks (grouped-query attention's key/value heads), each block is
    /// held by `shared_by` neighbouring ranks, which sum its gradient.
    Columns {
        /// Ranks holding each block.
        shared_by: usize,
    },
    /// Row-parallel: the input features (`[in, out]`'s rows) split over the group; the ranks'
    /// partial products are summed.
    Rows,
    /// Vocab-parallel embedding: its rows, one per token id, split over the group.
    VocabRows,
    /// Vocab-parallel head: its columns, one per token id, split over the group; the loss
    /// never gathers the logits.
    VocabColumns,
    /// A block's experts stacked along dimension 0, split over the expert-parallel ranks; each
    /// expert's matrix split along `tp_dim` over the tensor-parallel group (gate and up by
    /// columns, down by rows, as an MLP's).
    Experts {
        /// The dimension of the stacked tensor split over the tensor-parallel group.
        tp_dim: usize,
    },
}

impl Placement {
    /// The dimension split, and into how many blocks, over `tp` ranks; none when replicated.
    pub fn split(self, tp: usize) -> Option<(usize, usize)> {
        match self {
            Self::Replicated => None,
            Self::Columns { shared_by } => Some((1, tp / shared_by)),
            Self::Rows | Self::VocabRows => Some((0, tp)),
            Self::VocabColumns => Some((1, tp)),
            Self::Experts { tp_dim } => Some((tp_dim, tp)),
        }
    }

    /// The shape each rank holds of a parameter shaped `whole`, split over `tp`
    /// tensor-parallel and `ep` expert-parallel ranks.
    pub fn shape_per_rank(self, whole: &[usize], tp: usize, ep: usize) -> Vec<usize> {
        let mut shape = whole.to_vec();
        if let Some((dim, blocks)) = self.split(tp) {
            shape[dim] /= blocks;
        }
        if let Self::Experts { .. } = self {
            shape[0] /= ep;
        }
        shape
    }

    fn name(self) -> String {
        match self {
            Self::Replicated => "replicated".into(),
            Self::Columns { shared_by: 1 } => "column-parallel".into(),
            Self::Columns { shared_by } => format!("column-parallel, each block on {shared_by}"),
            Self::Rows => "row-parallel".into(),
            Self::VocabRows => "vocab-parallel rows".into(),
            Self::VocabColumns => "vocab-parallel columns".into(),
            Self::Experts { tp_dim: 2 } => "experts over ep, columns over tp".into(),
            Self::Experts { .. } => "experts over ep, rows over tp".into(),
        }
    }
}

/// Where this rank sits in the groups the plan splits parameters over.
#[derive(Debug, Clone, Copy, Default)]
pub struct Slices<'a> {
    /// The tensor-parallel group; none when matrices are whole.
    pub tp: Option<&'a TensorParallel>,
    /// How the experts are split; none when every expert is here.
    pub ep: Option<&'a ExpertParallel>,
}

impl<'a> Slices<'a> {
    /// Split over `tp` only.
    pub fn tp(tp: Option<&'a TensorParallel>) -> Self {
        Self { tp, ep: None }
    }
}

/// One rule of the plan: the parameters whose path matches `path` (`*` standing for a block's
/// index), their whole shape and their placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The parameter path, as burn's module visitors name it, a block's index as `*`.
    pub path: &'static str,
    /// The whole parameter's shape.
    pub shape: Vec<usize>,
    /// How the tensor-parallel ranks hold it.
    pub placement: Placement,
}

impl Rule {
    /// The elements of this parameter a rank at `at` holds along each dimension it does not
    /// hold whole; empty when it holds it all.
    pub fn block_of(&self, at: Slices<'_>) -> Result<Vec<(usize, Range<usize>)>, TrainError> {
        let mut split = Vec::new();
        if let (Placement::Experts { .. }, Some(ep)) = (self.placement, at.ep)
            && ep.size() > 1
        {
            split.push((0, ep.local_experts()));
        }
        if let Some(tp) = at.tp
            && let Some((dim, blocks)) = self.placement.split(tp.size())
        {
            split.push((dim, tp.block_range(self.shape[dim], blocks)?));
        }
        Ok(split)
    }
}

/// A run's parallel plan (see the module's documentation).
#[derive(Debug, Clone)]
pub struct ParallelPlan {
    /// The run's dimensions.
    pub dims: ParallelDims,
    /// Whether activations between the tensor-parallel regions are split along the sequence.
    pub sequence_parallel: bool,
    /// Every parameter's rule.
    pub rules: Vec<Rule>,
    /// The blocks of each of the `pp x virtual_stages` pipeline stages, by parameter count
    /// (`--balance time` measures them again before training); one stage without a pipeline.
    pub stages: Vec<Range<usize>>,
    /// ZeRO-3's units, one block each (the embedding with the first, the final norm and head
    /// with the last); none below ZeRO-3.
    pub units: Option<Vec<Range<usize>>>,
    balance: Balance,
}

impl ParallelPlan {
    /// The plan of `config`, or a sentence saying what to change when the model does not
    /// split over its layout.
    pub fn new(config: &TrainConfig) -> Result<Self, TrainError> {
        let dims = ParallelDims::of(config);
        let model = &config.model;
        check_split(model, dims.tp, config.sequence_parallel, config.seq_len)
            .map_err(TrainError::Config)?;
        let stages = match dims.pp {
            1 => std::iter::once(0..model.num_hidden_layers).collect(),
            pp => split(model, pp, config.virtual_stages)?,
        };
        let units = (config.zero == ZeroStage::Parameters)
            .then(|| (0..model.num_hidden_layers).map(|i| i..i + 1).collect());
        Ok(Self {
            dims,
            sequence_parallel: config.sequence_parallel,
            rules: rules(model, dims.tp),
            stages,
            units,
            balance: config.balance,
        })
    }

    /// The rule of the parameter at `path` (a block's index in it is any number).
    pub fn rule(&self, path: &str) -> Option<&Rule> {
        let generic: Vec<&str> = path
            .split('.')
            .map(|part| match part.parse::<usize>() {
                Ok(_) => "*",
                Err(_) => part,
            })
            .collect();
        let generic = generic.join(".");
        self.rules.iter().find(|rule| rule.path == generic)
    }

    /// This rank's part of `model` (the whole model, a stage or a unit): each parameter cut as
    /// its rule says over `tp`; the model as it is without tensor parallelism.
    pub fn shard<B: Backend>(
        &self,
        model: Llama<B>,
        tp: Option<&TensorParallel>,
    ) -> Result<Llama<B>, TrainError> {
        let Some(tp) = tp else {
            return Ok(model);
        };
        self.make_groups(tp)?;
        // Every expert is kept: a rank's experts are picked when its parts are loaded.
        let mut mapper = PathMapper::new(self, SplitOp::Cut(tp));
        let model = model.map(&mut mapper);
        mapper.finish()?;
        Ok(model.with_tp(Some(tp.clone())))
    }

    /// `part` (of a `Llama::shell`) with every parameter read from `source`: of a split
    /// parameter, this rank's block at `at` only (its tensor-parallel slice, its experts).
    /// What [`shard`](Self::shard) gives of the whole model, without it.
    pub fn load<B: Backend>(
        &self,
        part: Llama<B>,
        at: Slices<'_>,
        source: &dyn ParamSource,
    ) -> Result<Llama<B>, TrainError> {
        if let Some(tp) = at.tp {
            self.make_groups(tp)?;
        }
        self.check_experts(at.ep)?;
        let first_layer = part.part().layers.start;
        let op = SplitOp::Load {
            source,
            at,
            first_layer,
        };
        let mut mapper = PathMapper::new(self, op);
        let part = part.map(&mut mapper);
        mapper.finish()?;
        Ok(part.with_tp(at.tp.cloned()))
    }

    /// Fails unless `ep` splits the experts over the plan's expert-parallel ranks.
    fn check_experts(&self, ep: Option<&ExpertParallel>) -> Result<(), TrainError> {
        let size = ep.map_or(1, ExpertParallel::size);
        if size != self.dims.ep {
            return Err(TrainError::Config(format!(
                "the plan splits the experts over {} expert-parallel ranks, but the group has {size}",
                self.dims.ep
            )));
        }
        Ok(())
    }

    /// Checks `tp` against the plan and makes the groups of ranks sharing a block, in the same
    /// order on every rank.
    fn make_groups(&self, tp: &TensorParallel) -> Result<(), TrainError> {
        self.check_group(tp)?;
        for rule in &self.rules {
            if let Placement::Columns { shared_by } = rule.placement
                && shared_by > 1
            {
                tp.replica_group(tp.size() / shared_by)?;
            }
        }
        Ok(())
    }

    /// The whole of `model` (cut by [`shard`](Self::shard)), gathered from its tensor-parallel
    /// group (a collective); the model as it is when it is not split. Either way it comes back
    /// computing on whole sequences (context-parallel ranks hold the same weights).
    pub fn gather<B: Backend>(&self, model: Llama<B>) -> Result<Llama<B>, TrainError> {
        let model = model.with_cp(None);
        let tp = model.part().tp.clone();
        let ep = model
            .part()
            .experts
            .as_ref()
            .map(|experts| experts.ep.clone())
            .filter(|ep| ep.size() > 1);
        if tp.is_none() && ep.is_none() {
            return Ok(model.with_experts(None));
        }
        if let Some(tp) = &tp {
            self.check_group(tp)?;
        }
        let at = Slices {
            tp: tp.as_ref(),
            ep: ep.as_ref(),
        };
        let mut mapper = PathMapper::new(self, SplitOp::Gather(at));
        let model = model.map(&mut mapper);
        mapper.finish()?;
        Ok(model.with_tp(None).with_experts(None))
    }

    /// Fails unless `tp` has the plan's tensor-parallel ranks.
    fn check_group(&self, tp: &TensorParallel) -> Result<(), TrainError> {
        if tp.size() != self.dims.tp {
            return Err(TrainError::Config(format!(
                "the plan splits over {} tensor-parallel ranks, but the group has {}",
                self.dims.tp,
                tp.size()
            )));
        }
        Ok(())
    }

    /// The plan as `--print-plan` prints it.
    pub fn describe(&self, model: &LlamaConfig) -> String {
        let ParallelDims { dp, pp, cp, tp, ep } = self.dims;
        let (then_cp, then_ep) = (
            if cp > 1 { ", then cp" } else { "" },
            if ep > 1 { ", then ep" } else { "" },
        );
        let mut out = format!(
            "parallel plan: {} = {} ranks (tp fastest{then_cp}, then pp{then_ep})",
            self.dims.describe(),
            self.dims.ranks()
        );
        if cp > 1 {
            let _ = write!(
                out,
                "; every sequence split over the {cp} context-parallel ranks"
            );
        }
        out.push('\n');
        let sp = if self.sequence_parallel {
            ", sequence parallel: activations between the regions split along the sequence"
        } else {
            ""
        };
        let _ = writeln!(out, "\ntensor parallelism over {tp} rank(s){sp}");
        let _ = writeln!(
            out,
            "  {:<40} {:<34} {:>14} {:>14}",
            "parameter", "placement", "whole", "per rank"
        );
        for rule in &self.rules {
            let _ = writeln!(
                out,
                "  {:<40} {:<34} {:>14} {:>14}",
                rule.path,
                rule.placement.name(),
                format!("{:?}", rule.shape),
                format!("{:?}", rule.placement.shape_per_rank(&rule.shape, tp, ep)),
            );
        }
        if model.is_moe() {
            let router = model.router();
            let capacity = match router.capacity_factor {
                Some(factor) => format!("capacity factor {factor}"),
                None => "dropless".into(),
            };
            let _ = writeln!(
                out,
                "\nexpert parallelism: {} experts per block over {ep} rank(s), {} each; top-{} routing, {capacity}; experts' gradients summed over the dp x cp ranks holding them and scaled to the average over dp x ep x cp, the rest averaged over dp x ep x cp",
                router.experts,
                router.experts / ep,
                router.top_k,
            );
        }
        if model.tie_word_embeddings {
            let copy = if self.stages.len() > 1 {
                "; the last stage holds a copy, its gradient summed with the first stage's"
            } else {
                ""
            };
            let _ = writeln!(out, "  (lm_head is tied to embed_tokens{copy})");
        }
        let last = self.stages.len() - 1;
        let balance = match self.balance {
            Balance::Params => "balanced by parameter count",
            Balance::Time => "by parameter count here; --balance time measures them again",
        };
        let _ = writeln!(
            out,
            "\npipeline: {} stage(s) on {pp} rank(s), {balance}",
            self.stages.len()
        );
        for (s, blocks) in self.stages.iter().enumerate() {
            let _ = writeln!(
                out,
                "  stage {s} (pp rank {}): {}",
                s % pp,
                part_names(blocks, s == 0, s == last)
            );
        }
        match &self.units {
            Some(units) => {
                let _ = writeln!(
                    out,
                    "\nZeRO-3: {} unit(s), each gathered for its forward and backward and sharded over dp {dp}:",
                    units.len()
                );
                let last = units.len() - 1;
                for (u, blocks) in units.iter().enumerate() {
                    let _ = writeln!(out, "  unit {u}: {}", part_names(blocks, u == 0, u == last));
                }
                if model.tie_word_embeddings && last > 0 {
                    let _ = writeln!(
                        out,
                        "  (the tied lm_head is embed_tokens, sharded once with unit 0: unit {last} gathers it again and adds its gradient to unit 0's)"
                    );
                }
            }
            None => {
                let _ = writeln!(out, "\ndata parallelism: {dp} replica(s)");
            }
        }
        out
    }
}

/// What a part holding `blocks` holds, in words.
fn part_names(blocks: &Range<usize>, first: bool, last: bool) -> String {
    let mut names = Vec::new();
    if first {
        names.push("embed_tokens".to_string());
    }
    names.push(format!("layers {}..{}", blocks.start, blocks.end));
    if last {
        names.push("norm, lm_head".to_string());
    }
    names.join(", ")
}

/// Every parameter of a model shaped `model` and its placement over `tp` ranks: Megatron's
/// layout of a Llama block.
fn rules(model: &LlamaConfig, tp: usize) -> Vec<Rule> {
    let (h, f, v) = (model.hidden_size, model.intermediate_size, model.vocab_size);
    let kv = model.num_key_value_heads * model.head_dim();
    let kv_shared_by = (tp / model.num_key_value_heads).max(1);
    let rule = |path, shape: &[usize], placement| Rule {
        path,
        shape: shape.to_vec(),
        placement,
    };
    let columns = Placement::Columns { shared_by: 1 };
    let kv_columns = Placement::Columns {
        shared_by: kv_shared_by,
    };
    let mut rules = vec![
        rule("embed_tokens", &[v, h], Placement::VocabRows),
        rule(
            "layers.*.input_layernorm.weight",
            &[h],
            Placement::Replicated,
        ),
        rule("layers.*.self_attn.q_proj", &[h, h], columns),
        rule("layers.*.self_attn.k_proj", &[h, kv], kv_columns),
        rule("layers.*.self_attn.v_proj", &[h, kv], kv_columns),
        rule("layers.*.self_attn.o_proj", &[h, h], Placement::Rows),
        rule(
            "layers.*.post_attention_layernorm.weight",
            &[h],
            Placement::Replicated,
        ),
        rule("norm.weight", &[h], Placement::Replicated),
    ];
    if model.is_moe() {
        let e = model.num_local_experts;
        rules.extend([
            rule("layers.*.moe.router", &[h, e], Placement::Replicated),
            rule(
                "layers.*.moe.gate",
                &[e, h, f],
                Placement::Experts { tp_dim: 2 },
            ),
            rule(
                "layers.*.moe.up",
                &[e, h, f],
                Placement::Experts { tp_dim: 2 },
            ),
            rule(
                "layers.*.moe.down",
                &[e, f, h],
                Placement::Experts { tp_dim: 1 },
            ),
        ]);
    } else {
        rules.extend([
            rule("layers.*.mlp.gate_proj", &[h, f], columns),
            rule("layers.*.mlp.up_proj", &[h, f], columns),
            rule("layers.*.mlp.down_proj", &[f, h], Placement::Rows),
        ]);
    }
    if !model.tie_word_embeddings {
        rules.push(rule("lm_head", &[h, v], Placement::VocabColumns));
    }
    rules
}

/// Every parameter of the whole model shaped `model`: its path (as burn's visitors name it) and
/// its shape.
pub fn parameters(model: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for rule in rules(model, 1) {
        match rule.path.split_once("*.") {
            Some((head, tail)) => out.extend(
                (0..model.num_hidden_layers)
                    .map(|i| (format!("{head}{i}.{tail}"), rule.shape.clone())),
            ),
            None => out.push((rule.path.to_string(), rule.shape)),
        }
    }
    out
}

/// Checks that `config` can be split over `tp` ranks (and, with `sequence_parallel`, sequences
/// of `seq_len` tokens too), with a sentence saying what to change.
pub fn check_split(
    config: &LlamaConfig,
    tp: usize,
    sequence_parallel: bool,
    seq_len: usize,
) -> Result<(), String> {
    // The hidden size is heads x head width, so it divides whenever the heads do.
    let must_divide = [
        ("num_attention_heads", config.num_attention_heads),
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
    ];
    for (name, value) in must_divide {
        if !value.is_multiple_of(tp) {
            return Err(format!(
                "--tp {tp} does not divide {name} {value}; choose --tp among {}",
                divisors(value)
            ));
        }
    }
    check_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        .map_err(|e| format!("--tp {tp}: {e}"))?;
    if sequence_parallel && !seq_len.is_multiple_of(tp) {
        return Err(format!(
            "--sp splits each sequence over the {tp} tensor-parallel ranks, but --seq-len {seq_len} does not divide by {tp}; choose a --seq-len that is a multiple of {tp}"
        ));
    }
    Ok(())
}

/// What is done to each split parameter, over the groups it is split over.
#[derive(Clone, Copy)]
enum SplitOp<'a> {
    /// Keep this rank's tensor-parallel block.
    Cut(&'a TensorParallel),
    /// All-gather the blocks into the whole: the tensor-parallel blocks, then the experts.
    Gather(Slices<'a>),
    /// Read every parameter (this rank's block of a split one) from `source`, into a part
    /// whose blocks start at `first_layer`.
    Load {
        source: &'a dyn ParamSource,
        at: Slices<'a>,
        first_layer: usize,
    },
}

impl SplitOp<'_> {
    /// `tensor`, placed as `placement` says over `tp` ranks, cut or gathered.
    fn apply<B: Backend, const D: usize>(
        self,
        tensor: Tensor<B, D>,
        placement: Placement,
        tp: usize,
    ) -> Result<Tensor<B, D>, TrainError> {
        let split = placement.split(tp);
        Ok(match self {
            Self::Cut(group) => {
                let Some((dim, blocks)) = split else {
                    return Ok(tensor);
                };
                // The block is a leaf of its own, tracked as the whole was.
                let tracked = tensor.is_require_grad();
                let block = group.block_of(tensor, dim, blocks)?;
                if tracked { block.require_grad() } else { block }
            }
            Self::Gather(at) => {
                let mut tensor = tensor.detach();
                if let (Some(group), Some((dim, blocks))) = (at.tp, split) {
                    tensor = group.gather_blocks(tensor, dim, blocks)?;
                }
                if let (Placement::Experts { .. }, Some(comm)) =
                    (placement, at.ep.and_then(ExpertParallel::comm))
                {
                    tensor = comm.all_gather(tensor, 0)?;
                }
                tensor
            }
            Self::Load { .. } => unreachable!("a load reads, it does not split"),
        })
    }
}

/// `path` of a part whose blocks start at `first_layer`, in the whole model.
pub(crate) fn whole_path(path: &str, first_layer: usize) -> String {
    match path
        .strip_prefix("layers.")
        .and_then(|rest| rest.split_once('.'))
    {
        Some((i, tail)) => {
            let i: usize = i.parse().expect("a block's path holds its index");
            format!("layers.{}.{tail}", first_layer + i)
        }
        None => path.to_string(),
    }
}

/// Applies a [`SplitOp`] to every split parameter by its path; the first failure, or a
/// parameter without a rule, is kept for [`finish`](Self::finish).
struct PathMapper<'a> {
    plan: &'a ParallelPlan,
    op: SplitOp<'a>,
    path: Vec<String>,
    failed: Option<TrainError>,
}

impl<'a> PathMapper<'a> {
    fn new(plan: &'a ParallelPlan, op: SplitOp<'a>) -> Self {
        Self {
            plan,
            op,
            path: Vec::new(),
            failed: None,
        }
    }

    fn finish(self) -> Result<(), TrainError> {
        self.failed.map_or(Ok(()), Err)
    }
}

impl<B: Backend> ModuleMapper<B> for PathMapper<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if self.failed.is_some() {
            return param;
        }
        let path = self.path.join(".");
        let tp = self.plan.dims.tp;
        let Some(rule) = self.plan.rule(&path) else {
            self.failed = Some(TrainError::Config(format!(
                "the parallel plan has no rule for the parameter `{path}`"
            )));
            return param;
        };
        if let SplitOp::Load {
            source,
            at,
            first_layer,
        } = self.op
        {
            let path = whole_path(&path, first_layer);
            return load(param, rule, &path, source, at, &mut self.failed);
        }
        // Cut from the whole; gathered from this rank's part.
        let expected = match self.op {
            SplitOp::Cut(_) => rule.shape.clone(),
            SplitOp::Gather(at) => {
                let ep = at.ep.map_or(1, ExpertParallel::size);
                rule.placement.shape_per_rank(&rule.shape, tp, ep)
            }
            SplitOp::Load { .. } => unreachable!("loaded above"),
        };
        if param.dims().as_slice() != expected.as_slice() {
            self.failed = Some(TrainError::Config(format!(
                "the parameter `{path}` is shaped {:?}, but the parallel plan expects {expected:?}",
                param.dims()
            )));
            return param;
        }
        param.map(
            |tensor| match self.op.apply(tensor.clone(), rule.placement, tp) {
                Ok(done) => done,
                Err(error) => {
                    self.failed = Some(error);
                    tensor
                }
            },
        )
    }
}

/// `param`, the parameter at `path` (in the whole model) under `rule`, read from `source`:
/// this rank's block over `tp` when the rule splits it. On failure, the parameter as it was
/// and the error in `failed`.
fn load<B: Backend, const D: usize>(
    param: Param<Tensor<B, D>>,
    rule: &Rule,
    path: &str,
    source: &dyn ParamSource,
    at: Slices<'_>,
    failed: &mut Option<TrainError>,
) -> Param<Tensor<B, D>> {
    let block = match rule.block_of(at) {
        Ok(split) => Block {
            path,
            whole: &rule.shape,
            split,
        },
        Err(error) => {
            *failed = Some(error);
            return param;
        }
    };
    let want = rule.placement.shape_per_rank(
        &rule.shape,
        at.tp.map_or(1, TensorParallel::size),
        at.ep.map_or(1, ExpertParallel::size),
    );
    let loaded = match source.block(&block) {
        Ok(Some(loaded)) => loaded,
        // Kept as built: only what the shell built whole (a norm's ones) can be.
        Ok(None) if param.dims().as_slice() == want.as_slice() => return param,
        Ok(None) => {
            *failed = Some(TrainError::Config(format!(
                "`{path}` was given no value, and the model was built without one"
            )));
            return param;
        }
        Err(error) => {
            *failed = Some(TrainError::Config(error));
            return param;
        }
    };
    param.map(|tensor| {
        let tracked = tensor.is_require_grad();
        let value = Tensor::<B, D>::from_data(loaded.data, &tensor.device());
        let value = if loaded.transposed {
            value.transpose()
        } else {
            value
        };
        if value.dims().as_slice() != want.as_slice() {
            *failed = Some(TrainError::Config(format!(
                "`{path}` was read shaped {:?}, but this rank holds {want:?} of it",
                value.dims()
            )));
            return tensor;
        }
        if tracked { value.require_grad() } else { value }
    })
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn_ddp::params::{ParamVisitor, visit_params};

    use super::*;

    /// Every parameter path and shape of a model.
    fn paths(model: &Llama<Flex>) -> Vec<(String, Vec<usize>)> {
        struct Paths(Vec<(String, Vec<usize>)>);
        impl<B: Backend> ParamVisitor<B> for Paths {
            fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
                self.0.push((path.to_string(), param.dims().to_vec()));
            }
        }
        let mut paths = Paths(Vec::new());
        visit_params(model, &mut paths);
        paths.0
    }

    #[test]
    fn every_parameter_of_the_model_has_one_rule_of_its_shape() {
        for tied in [false, true] {
            let model = LlamaConfig::preset("tiny")
                .unwrap()
                .with_tie_word_embeddings(tied);
            let mut config = TrainConfig::new(model.clone(), 1);
            config.tp = 2;
            let plan = ParallelPlan::new(&config).unwrap();
            let found = paths(&Llama::init(&model, 1, &Default::default()));
            assert_eq!(
                found.len(),
                2 + 9 * model.num_hidden_layers + !tied as usize
            );
            for (path, shape) in &found {
                let rule = plan
                    .rule(path)
                    .unwrap_or_else(|| panic!("no rule for {path}"));
                assert_eq!(&rule.shape, shape, "{path}");
            }
            // And no rule names a parameter the model lacks.
            for rule in &plan.rules {
                let matches = |(path, _): &(String, Vec<usize>)| {
                    plan.rule(path).map(|r| r.path) == Some(rule.path)
                };
                assert!(found.iter().any(matches), "{}", rule.path);
            }
        }
    }

    #[test]
    fn the_plan_prints_every_placement_stage_and_unit() {
        let model = LlamaConfig::preset("tiny").unwrap();
        let mut config = TrainConfig::new(model.clone(), 1);
        (config.dp, config.pp, config.tp) = (2, 2, 4);
        config.strategy = crate::train::Strategy::Ddp;
        let text = ParallelPlan::new(&config).unwrap().describe(&model);
        for expected in [
            "dp 2 x pp 2 x tp 4 = 16 ranks",
            "layers.*.self_attn.k_proj                column-parallel, each block on 2",
            "layers.*.mlp.down_proj                   row-parallel",
            "embed_tokens                             vocab-parallel rows",
            "[256, 128]",
            "[64, 128]",
            "[128, 32]",
            "stage 0 (pp rank 0): embed_tokens, layers 0..",
            "norm, lm_head",
        ] {
            assert!(text.contains(expected), "{expected:?} in\n{text}");
        }
        config.pp = 1;
        config.zero = ZeroStage::Parameters;
        let text = ParallelPlan::new(&config).unwrap().describe(&model);
        assert!(text.contains("ZeRO-3: 4 unit(s)"), "{text}");
        assert!(
            text.contains("unit 3: layers 3..4, norm, lm_head"),
            "{text}"
        );
        let tied = model.with_tie_word_embeddings(true);
        config.model = tied.clone();
        let text = ParallelPlan::new(&config).unwrap().describe(&tied);
        assert!(text.contains("sharded once with unit 0: unit 3"), "{text}");
    }

    /// A mixture of experts cut by `shard` over tp (every expert kept, each split) computes the
    /// whole model's loss: its experts' partial products are summed over the group.
    #[test]
    fn a_mixture_of_experts_cut_over_tp_computes_the_whole_models_loss() {
        let model = LlamaConfig::preset("tiny-moe").unwrap();
        let tokens = burn::tensor::Tensor::<Flex, 2, burn::tensor::Int>::from_ints(
            [[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]],
            &Default::default(),
        );
        let loss = |m: &Llama<Flex>| -> Result<f32, TrainError> {
            Ok(m.loss(tokens.clone(), tokens.clone().flip([1]))?
                .into_scalar())
        };
        let whole = loss(&Llama::init(&model, 3, &Default::default())).unwrap();
        let results = burn_comm::launch(2, |ctx| {
            let mut config = TrainConfig::new(model.clone(), 1);
            config.tp = 2;
            let plan = ParallelPlan::new(&config)?;
            let tp = TensorParallel::new(ctx.world().clone());
            let part = plan.shard(Llama::init(&model, 3, &Default::default()), Some(&tp))?;
            loss(&part)
        });
        for result in results {
            let split = result.unwrap();
            assert!(
                (split - whole).abs() <= 1e-5 * whole,
                "{split} against {whole}"
            );
        }
    }
}
