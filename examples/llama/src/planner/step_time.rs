//! The time of one training step of a layout on a cluster, from first principles: every
//! matrix multiplication from its shape at the fraction of peak such a shape reaches, every
//! elementwise pass from the bytes it streams, every collective from the alpha-beta model of
//! the link its group crosses, the pipeline's bubble from burn-pipeline's simulation of the
//! schedule with these costs, and the optimizer's step from the state it streams.

use std::collections::HashMap;

use burn_pipeline::{Costs, Schedule, ScheduleKind, simulate};
use burn_tensor_parallel::CpAttention;
use burn_zero::ZeroStage;

use super::cluster::{Cluster, Link};
use crate::config::LlamaConfig;

/// A decoder-only transformer's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Width of the residual stream.
    pub hidden: f64,
    /// Width of the MLP's hidden layer (of each expert's, in a mixture of experts).
    pub ffn: f64,
    /// A gated MLP (SwiGLU: three matrices) rather than two matrices and a GeLU.
    pub gated: bool,
    /// Query heads.
    pub heads: f64,
    /// Key/value heads.
    pub kv_heads: f64,
    /// Blocks.
    pub layers: usize,
    /// Tokens in the vocabulary.
    pub vocab: f64,
    /// The head reads the embedding's weight.
    pub tied_embeddings: bool,
    /// Each block's MLP is a mixture of these experts.
    pub experts: Option<Experts>,
}

/// A mixture of experts in place of each block's MLP.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Experts {
    /// Experts per block.
    pub count: f64,
    /// Experts each token visits.
    pub top_k: f64,
}

/// The parameters one rank holds: those data parallelism reduces over all its ranks, and
/// the experts', reduced over the ranks holding the same experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Held {
    /// Everything but the experts.
    pub dense: f64,
    /// This rank's experts.
    pub experts: f64,
}

impl Shape {
    /// A Llama model's shape, with its experts if it has them (dropless: a capacity factor
    /// only ever drops copies, which this model does not time).
    pub fn llama(model: &LlamaConfig) -> Self {
        Self {
            hidden: model.hidden_size as f64,
            ffn: model.intermediate_size as f64,
            gated: true,
            heads: model.num_attention_heads as f64,
            kv_heads: model.num_key_value_heads as f64,
            layers: model.num_hidden_layers,
            vocab: model.vocab_size as f64,
            tied_embeddings: model.tie_word_embeddings,
            experts: model.is_moe().then(|| Experts {
                count: model.num_local_experts as f64,
                top_k: model.num_experts_per_tok.min(model.num_local_experts) as f64,
            }),
        }
    }

    /// A GPT model as Megatron-LM's papers train it: `4 h` MLP with GeLU, as many key/value
    /// heads as query heads, the head tied to the embedding.
    pub fn gpt(hidden: usize, heads: usize, layers: usize, vocab: usize) -> Self {
        Self {
            hidden: hidden as f64,
            ffn: 4.0 * hidden as f64,
            gated: false,
            heads: heads as f64,
            kv_heads: heads as f64,
            layers,
            vocab: vocab as f64,
            tied_embeddings: true,
            experts: None,
        }
    }

    /// Width of one head.
    pub fn head_dim(&self) -> f64 {
        self.hidden / self.heads
    }

    /// Width of the keys (and of the values) of all key/value heads.
    fn kv_width(&self) -> f64 {
        self.kv_heads * self.head_dim()
    }

    /// Parameters of one MLP (of one expert's, in a mixture of experts).
    fn mlp_params(&self) -> f64 {
        let matrices = if self.gated { 3.0 } else { 2.0 };
        matrices * self.hidden * self.ffn
    }

    /// Parameters of one block with `experts` of its experts (the router counted whole).
    fn block_params_using(&self, experts: f64) -> f64 {
        let h = self.hidden;
        let mlp = match self.experts {
            None => self.mlp_params(),
            Some(mixture) => h * mixture.count + experts * self.mlp_params(),
        };
        h * (h + 2.0 * self.kv_width()) + h * h + mlp + 2.0 * h
    }

    /// Parameters of one block.
    pub fn block_params(&self) -> f64 {
        self.block_params_using(self.experts.map_or(1.0, |e| e.count))
    }

    /// Parameters of the whole model.
    pub fn params(&self) -> f64 {
        let tables = if self.tied_embeddings { 1.0 } else { 2.0 };
        self.layers as f64 * self.block_params() + tables * self.vocab * self.hidden + self.hidden
    }

    /// Parameters of every block's experts (none in a dense model).
    fn expert_params(&self) -> f64 {
        self.experts
            .map_or(0.0, |e| self.layers as f64 * e.count * self.mlp_params())
    }

    /// Parameters each of `tp x pp` ranks holds, the experts split over `ep` more: an even
    /// share, the routers whole, and the key/value heads copied on several tensor-parallel
    /// ranks when there are fewer heads than ranks.
    pub fn held(&self, tp: usize, pp: usize, ep: usize) -> Held {
        let t = tp as f64;
        let copied = 2.0 * self.hidden * (self.kv_width_per_rank(t) - self.kv_width() / t);
        let experts = self.expert_params();
        // Every tensor-parallel rank routes its tokens with the whole router.
        let routers = self.layers as f64 * self.experts.map_or(0.0, |e| e.count * self.hidden);
        Held {
            dense: (self.params() - experts - routers) / (tp * pp) as f64
                + routers / pp as f64
                + self.layers.div_ceil(pp) as f64 * copied,
            experts: experts / (tp * pp * ep) as f64,
        }
    }

    /// Width of the keys (and of the values) each of `tp` ranks computes: its share of the
    /// key/value heads, or one head's copy when there are fewer heads than ranks.
    fn kv_width_per_rank(&self, tp: f64) -> f64 {
        self.kv_width() / tp.min(self.kv_heads)
    }

    /// Floating-point operations a step does per token, forward and backward, without
    /// recompute and counting attention's whole `s x s` products: `6` per weight a token uses
    /// (its `top-k` experts only) and `12 l h s` for attention (the convention of the
    /// Megatron-LM and PaLM papers' model FLOPs).
    pub fn model_flops_per_token(&self, seq_len: usize) -> f64 {
        let active = self.block_params_using(self.experts.map_or(1.0, |e| e.top_k));
        let weights = self.layers as f64 * (active - 2.0 * self.hidden) + self.vocab * self.hidden;
        6.0 * weights + 12.0 * self.layers as f64 * self.hidden * seq_len as f64
    }
}

/// Which activations the backward recomputes instead of keeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// None: everything is kept.
    None,
    /// Attention's scores, softmax and context only (Korthikanti et al., 2022).
    Selective,
    /// Each block's whole forward, from its input.
    Full,
    /// torchtitan's per-op selective checkpointing: the backward runs each block's forward
    /// again, taking attention's output and every odd matrix product's from memory and
    /// computing the rest: the 2nd, 4th and 6th products (keys, output projection, one MLP
    /// matrix), the elementwise work and the all-gathers.
    EverySecondMatmul,
}

/// How a training system runs a layout, where systems differ.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Engine {
    /// Bytes of an activation element.
    pub compute_bytes: f64,
    /// Bytes of a gradient element as data parallelism reduces it.
    pub grad_bytes: f64,
    /// Attention is one fused kernel (FlashAttention) reaching this fraction of the device's
    /// peak: it never writes its scores to memory, skips the masked half of a causal product,
    /// and its backward computes the scores again (five products to the forward's two).
    pub flash_attention: Option<f64>,
    /// Bytes each attention score streams through memory in the forward (its write, scale,
    /// mask, softmax, dropout), where attention writes its scores.
    pub score_bytes: f64,
    /// How many times each elementwise operation's data crosses memory relative to one fused
    /// read and write (fused kernels: 1).
    pub elementwise_passes: f64,
    /// Dropout after attention and after the MLP (GPT).
    pub dropout: bool,
    /// Data-parallel gradient reduction overlaps the last micro-batch's backward.
    pub overlap_grad_reduce: bool,
    /// Tensor-parallel collectives overlap the linears' multiplications, each behind the
    /// product it is fused with (async TP: under sequence parallelism only, whose all-gathers
    /// and reduce-scatters it splits, and on devices computing on their own).
    pub overlap_tp: bool,
    /// A pipeline message is split over the tensor-parallel ranks (Megatron's scatter-gather).
    pub split_pipeline_messages: bool,
    /// ZeRO-3 runs the forward of every block but the last twice, untracked and again before
    /// its backward (burn-zero: burn's tape would otherwise keep every gathered weight alive;
    /// the last unit, with the head, stays gathered and runs once).
    pub zero3_forward_twice: bool,
    /// The share of the communication it runs behind computation that a step pays anyway: the
    /// collectives' kernels take the device's multiprocessors and memory bandwidth, and a
    /// system may hold its prefetches back (0: hidden entirely). Tensor-parallel collectives
    /// overlapped with the linears (`overlap_tp`) pay it too.
    pub overlap_cost: f64,
}

impl Engine {
    /// Seconds `comm` adds to a step when it runs behind `compute`: what does not fit behind
    /// it, and the share of the rest the system pays.
    fn behind(&self, comm: f64, compute: f64) -> f64 {
        (comm - compute).max(0.0) + self.overlap_cost * comm.min(compute)
    }
}

/// A layout to time: how the model and the batch are cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLayout {
    /// Data-parallel ranks.
    pub dp: usize,
    /// Expert-parallel ranks: each holds `1 / ep` of the experts and reads its own samples.
    pub ep: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Pipeline ranks.
    pub pp: usize,
    /// Context-parallel ranks: each holds `seq_len / cp` tokens of every sequence, in two
    /// chunks (load-balanced for the causal mask).
    pub cp: usize,
    /// How context-parallel attention reaches the other ranks' keys and values.
    pub cp_attention: CpAttention,
    /// Sequence parallelism within the tensor-parallel group.
    pub sp: bool,
    /// What ZeRO shards over the data-parallel ranks.
    pub zero: ZeroStage,
    /// What the backward recomputes.
    pub recompute: Recompute,
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step on each pipeline.
    pub micro_batches: usize,
    /// Tokens per sample.
    pub seq_len: usize,
    /// The pipeline's schedule (with `pp` above 1).
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank.
    pub virtual_stages: usize,
}

impl StepLayout {
    /// `dp` replicas, each running `micro_batches` micro-batches of `micro_batch` samples of
    /// `seq_len` tokens, with nothing else cut or recomputed: the base other layouts are
    /// written from.
    pub fn data_parallel(
        dp: usize,
        micro_batch: usize,
        micro_batches: usize,
        seq_len: usize,
    ) -> Self {
        Self {
            dp,
            ep: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            cp_attention: CpAttention::Ring,
            sp: false,
            zero: ZeroStage::Replicated,
            recompute: Recompute::None,
            micro_batch,
            micro_batches,
            seq_len,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
        }
    }

    /// Devices the layout uses.
    pub fn devices(&self) -> usize {
        self.dp * self.ep * self.cp * self.tp * self.pp
    }

    /// Samples per step over all devices.
    pub fn global_batch(&self) -> usize {
        self.dp * self.ep * self.micro_batch * self.micro_batches
    }

    /// The link a message between ranks of a group crosses, in the mesh `dp x ep x pp x cp x
    /// tp` (tp fastest): the devices from its first rank to its last, by the outermost
    /// dimension it spans.
    fn link(&self, cluster: &Cluster, dims: Dims) -> Link {
        cluster.link(self.span(dims), 1)
    }

    /// The link a ring collective over a group crosses: as [`Self::link`], with each of its
    /// ranks in a machine moving its share through its own network interface.
    fn ring(&self, cluster: &Cluster, dims: Dims) -> Link {
        cluster.ring(self.span(dims), || self.ranks_per_node(cluster, dims))
    }

    /// The mesh's dimensions, outermost first, each with whether the group spans it.
    fn sizes(&self, dims: Dims) -> [(bool, usize); 5] {
        [
            (dims.dp, self.dp),
            (dims.ep, self.ep),
            (dims.pp, self.pp),
            (dims.cp, self.cp),
            (dims.tp, self.tp),
        ]
    }

    /// Devices from a group's first rank to its last.
    fn span(&self, dims: Dims) -> usize {
        let sizes = self.sizes(dims);
        let outermost = sizes.iter().position(|&(within, size)| within && size > 1);
        outermost.map_or(1, |i| sizes[i..].iter().map(|(_, size)| size).product())
    }

    /// The fewest ranks of one group that share a machine, over the groups and the machines
    /// each reaches: the mesh lies over the devices in order, `devices_per_node` to a machine,
    /// and a ring moves as fast as its machine with the fewest network interfaces lets it.
    fn ranks_per_node(&self, cluster: &Cluster, dims: Dims) -> usize {
        let sizes = self.sizes(dims);
        let devices: usize = sizes.iter().map(|(_, size)| size).product();
        let per_node = cluster.devices_per_node.max(1);
        let mut counts: HashMap<(usize, usize), usize> = HashMap::new();
        for device in 0..devices {
            // A group is named by the device's coordinates outside the group's dimensions.
            let (mut rest, mut group) = (device, 0);
            for &(within, size) in sizes.iter().rev() {
                let coordinate = rest % size;
                rest /= size;
                if !within {
                    group = group * size + coordinate;
                }
            }
            *counts.entry((group, device / per_node)).or_default() += 1;
        }
        counts.into_values().min().unwrap_or(1)
    }
}

/// Which dimensions of the mesh a group spans.
#[derive(Debug, Clone, Copy)]
struct Dims {
    dp: bool,
    ep: bool,
    pp: bool,
    cp: bool,
    tp: bool,
}

impl Dims {
    /// None: the group of one rank.
    const NONE: Dims = Dims {
        dp: false,
        ep: false,
        pp: false,
        cp: false,
        tp: false,
    };
}

/// One step's predicted time, in seconds, by where the busiest rank spends it: the parts
/// sum to `total`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTime {
    /// Multiplications and elementwise work of the busiest rank (its blocks, recompute and,
    /// on the last stage, the head).
    pub compute: f64,
    /// What the step pays for its tensor-parallel collectives, on that rank: those waited
    /// for, and the share of overlapped ones the engine pays.
    pub tp_comm: f64,
    /// Context-parallel attention's keys and values (and their gradients) the computation
    /// waits for.
    pub cp_comm: f64,
    /// The all-to-alls that take tokens to their experts and back, forward and backward.
    pub ep_comm: f64,
    /// Idle while others work: the pipeline's bubble and message time, and thread ranks
    /// waiting for a core when there are more of them than cores.
    pub bubble: f64,
    /// Data-parallel communication the step waits for (what overlap leaves).
    pub dp_comm: f64,
    /// The optimizer's step over the state each rank holds.
    pub optimizer: f64,
    /// The step, from its first operation to the last.
    pub total: f64,
}

impl StepTime {
    /// Not predicted.
    pub const UNKNOWN: StepTime = StepTime {
        compute: f64::NAN,
        tp_comm: f64::NAN,
        cp_comm: f64::NAN,
        ep_comm: f64::NAN,
        bubble: f64::NAN,
        dp_comm: f64::NAN,
        optimizer: f64::NAN,
        total: f64::NAN,
    };

    /// The step's parts as `name seconds` pairs, for the printout.
    pub fn parts(&self) -> [(&'static str, f64); 7] {
        [
            ("compute", self.compute),
            ("tp comm", self.tp_comm),
            ("cp comm", self.cp_comm),
            ("ep comm", self.ep_comm),
            ("bubble", self.bubble),
            ("dp comm", self.dp_comm),
            ("optimizer", self.optimizer),
        ]
    }
}

/// What one micro-batch costs on one pipeline rank, in seconds.
#[derive(Debug, Clone, Copy)]
struct MicroBatch {
    forward: f64,
    backward: f64,
    tp_comm: f64,
    cp_comm: f64,
    ep_comm: f64,
    head: f64,
}

/// One step of `layout` for `shape` on `cluster`, as `engine` runs it; an error for a
/// schedule burn-pipeline refuses.
pub fn step_time(
    shape: &Shape,
    cluster: &Cluster,
    engine: &Engine,
    layout: &StepLayout,
) -> Result<StepTime, String> {
    let micro = micro_batch(shape, cluster, engine, layout);
    let m = layout.micro_batches;
    let send = {
        let tokens = (layout.micro_batch * layout.seq_len / layout.cp) as f64;
        let split = if engine.split_pipeline_messages || layout.sp {
            layout.tp as f64
        } else {
            1.0
        };
        // Stages are `cp x tp` ranks apart in the mesh (tp innermost); the schedule times
        // every hop alike, so the slowest one the pipeline crosses (interleaving sends from
        // the last rank back to the first).
        let link = layout.link(
            cluster,
            Dims {
                pp: true,
                ..Dims::NONE
            },
        );
        link.send(tokens * shape.hidden * engine.compute_bytes / split)
    };
    let blocks = micro.forward + micro.backward;
    let pipeline = match layout.pp {
        1 => m as f64 * blocks,
        pp => {
            let schedule = Schedule::new(layout.schedule, pp, m, layout.virtual_stages)
                .map_err(|e| e.to_string())?;
            let costs = Costs {
                forward: micro.forward,
                backward_input: micro.backward / 2.0,
                backward_weight: micro.backward / 2.0,
                send,
            };
            simulate(&schedule, &costs)
                .map_err(|e| e.to_string())?
                .makespan()
        }
    };
    // The last stage's head runs after its blocks, micro-batch by micro-batch: the rate of a
    // pipeline in its steady state is that of its slowest rank.
    let head = m as f64 * micro.head;
    let (dp_comm, optimizer) = data_parallel(shape, cluster, engine, layout, &micro);
    let mut total = pipeline + head + dp_comm + optimizer;
    // More thread ranks than cores: a rank's idle time is another's compute, and the step
    // lasts at least the work of all ranks shared over the cores.
    if let Some(cores) = cluster.shared_cores.filter(|&c| c < layout.devices()) {
        let ranks = layout.devices() as f64;
        let last_stage = (layout.dp * layout.ep * layout.cp * layout.tp) as f64;
        let work = ranks * (m as f64 * blocks + optimizer) + head * last_stage;
        total = total.max(work / cores as f64 + dp_comm);
    }
    let compute = m as f64 * (blocks - micro.tp_comm - micro.cp_comm - micro.ep_comm) + head;
    let (tp_comm, cp_comm, ep_comm) = (
        m as f64 * micro.tp_comm,
        m as f64 * micro.cp_comm,
        m as f64 * micro.ep_comm,
    );
    Ok(StepTime {
        compute,
        tp_comm,
        cp_comm,
        ep_comm,
        // Whatever the busiest rank is not computing or communicating (never below 0 but for
        // rounding).
        bubble: (total - (compute + tp_comm + cp_comm + ep_comm + dp_comm + optimizer)).max(0.0),
        dp_comm,
        optimizer,
        total,
    })
}

/// Forward and backward of one micro-batch through one pipeline rank's blocks (tensor
/// parallel collectives included), and the head's on the last.
fn micro_batch(
    shape: &Shape,
    cluster: &Cluster,
    engine: &Engine,
    layout: &StepLayout,
) -> MicroBatch {
    let (b, s, t, c) = (
        layout.micro_batch as f64,
        layout.seq_len as f64,
        layout.tp as f64,
        layout.cp as f64,
    );
    // This rank's tokens: its share of every sequence under context parallelism.
    let tokens = b * s / c;
    let (h, d) = (shape.hidden, shape.head_dim());
    let p = engine.compute_bytes;
    let heads = shape.heads / t;
    let kv_rank = shape.kv_width_per_rank(t);
    // `times` MLPs (or experts) on `rows` rows each: their products into the wide layer (two
    // when gated) and out of it.
    let mlps = |times: f64, rows: f64| {
        let up = if shape.gated { 2.0 } else { 1.0 };
        (
            times * up * cluster.matmul(1.0, rows, shape.ffn / t, h),
            times * cluster.matmul(1.0, rows, h, shape.ffn / t),
        )
    };
    // The MLP; or the router, and this rank's experts on the copies they receive: evenly
    // routed, `tokens x top-k` in all over its `experts / ep`.
    let (copies, router, (mlp_up, mlp_down)) = match shape.experts {
        None => (1.0, 0.0, mlps(1.0, tokens)),
        Some(e) => {
            let local = e.count / layout.ep as f64;
            let router = cluster.matmul(1.0, tokens, e.count, h);
            (e.top_k, router, mlps(local, tokens * e.top_k / local))
        }
    };
    let mlp = mlp_up + mlp_down;
    // One of the MLP's matrices (they cost alike): what torchtitan's per-op recompute runs again.
    let mlp_matrix = mlp / if shape.gated { 3.0 } else { 2.0 };
    let (qkv, keys, out) = (
        cluster.matmul(1.0, tokens, h / t + 2.0 * kv_rank, h),
        cluster.matmul(1.0, tokens, kv_rank, h),
        cluster.matmul(1.0, tokens, h, h / t),
    );
    let linears = qkv + out + router + mlp;
    // Elementwise work, in elements per token: on the whole residual stream (two norms, two
    // residual additions, dropouts), which sequence parallelism splits over tp, and on split
    // activations (the heads' reshapes, rotary, the MLP's activation).
    let dropout = if engine.dropout { 6.0 * h } else { 0.0 };
    let whole = 4.0 * h + 6.0 * h + dropout;
    let rotary = if shape.gated {
        2.0 * (h / t + kv_rank)
    } else {
        0.0
    };
    let activation = copies
        * if shape.gated {
            3.0 * shape.ffn
        } else {
            2.0 * shape.ffn
        }
        / t;
    // A token's copies gathered by expert, their outputs weighted and added back.
    let routing = if shape.experts.is_some() {
        4.0 * copies * h
    } else {
        0.0
    };
    let split = 2.0 * (h / t + 2.0 * kv_rank) + rotary + activation + routing;
    let whole_split = if layout.sp { t } else { 1.0 };
    let elementwise =
        cluster.stream(engine.elementwise_passes * p * tokens * (whole / whole_split + split));
    let (attention_forward, attention_backward) = match engine.flash_attention {
        // The causal half of the scores and of the context, at the kernel's own rate, shared
        // evenly by load-balanced context-parallel ranks.
        Some(efficiency) => {
            let forward = 2.0 * 2.0 * b * heads * s * (s / 2.0) * d / c;
            let forward = forward / (cluster.peak_flops * efficiency);
            (forward, 2.5 * forward)
        }
        None => {
            // Blocks of `rows x keys` scores, each masked where causal.
            let (blocks, rows, keys) = match (layout.cp, layout.cp_attention) {
                (1, _) => (1.0, s, s),
                (_, CpAttention::AllGather) => (1.0, s / c, s),
                // The ring computes the pairs of the `2 cp` chunks on or below the diagonal:
                // `2 cp + 1` on each rank.
                (_, CpAttention::Ring) => (2.0 * c + 1.0, s / (2.0 * c), s / (2.0 * c)),
            };
            let n = b * heads * blocks;
            let forward = cluster.matmul(n, rows, keys, d)
                + cluster.matmul(n, rows, d, keys)
                + cluster.stream(engine.score_bytes * n * rows * keys);
            (forward, 2.0 * forward)
        }
    };
    // Context parallelism. The ring passes this rank's keys and values on `cp - 1` times
    // forward and again backward, behind the blocks of scores where a device has cores of its
    // own; backward, each step's fp32 gradients of the keys and values it holds travel on after
    // its blocks and are waited for, and finished ones go back to their owner once more.
    // All-gather gathers them forward and reduce-scatters their gradients backward, waited for.
    let (cp_forward, cp_backward) = {
        let cp_dims = Dims {
            cp: true,
            ..Dims::NONE
        };
        let (link, ring) = (layout.link(cluster, cp_dims), layout.ring(cluster, cp_dims));
        let kv = tokens * 2.0 * kv_rank;
        let overlapped = |comm: f64, compute: f64| match cluster.shared_cores {
            Some(_) => comm,
            None => engine.behind(comm, compute),
        };
        match (layout.cp, layout.cp_attention) {
            (1, _) => (0.0, 0.0),
            (cp, CpAttention::Ring) => {
                let hops = (cp - 1) as f64;
                (
                    overlapped(hops * link.send(kv * p), attention_forward),
                    overlapped(hops * link.send(kv * p), attention_backward)
                        + cp as f64 * link.send(kv * 4.0),
                )
            }
            (cp, CpAttention::AllGather) => {
                let gather = ring.all_gather(kv * p * c, cp);
                (gather, gather)
            }
        }
    };
    // A block's fixed cost, shared as its work is: a third forward, two thirds backward.
    let fixed = cluster.block_overhead
        + shape.experts.map_or(0.0, |e| {
            cluster.routing_overhead + e.count / layout.ep as f64 * cluster.expert_overhead
        });
    let layer_forward = linears + attention_forward + elementwise + fixed / 3.0;
    let layer_backward = 2.0 * (layer_forward - attention_forward) + attention_backward;
    let layer_recompute = match layout.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => attention_forward,
        Recompute::Full => layer_forward,
        Recompute::EverySecondMatmul => keys + out + mlp_matrix + elementwise + fixed / 3.0,
    };

    // Tensor parallelism: two all-reduces forward, of attention's output and the MLP's (of
    // the experts' outputs, a row per copy, in a mixture), and two backward (a reduce-scatter
    // and all-gather each under sequence parallelism, which gathers its input once more in
    // backward), and the recomputed forward's.
    let tp_link = layout.ring(
        cluster,
        Dims {
            tp: true,
            ..Dims::NONE
        },
    );
    let (attention_ar, mlp_ar) = match layout.tp {
        1 => (0.0, 0.0),
        tp => (
            tp_link.all_reduce(tokens * h * p, tp),
            tp_link.all_reduce(tokens * copies * h * p, tp),
        ),
    };
    let pair = attention_ar + mlp_ar;
    let backward_share = if layout.sp { 1.5 } else { 1.0 };
    let recomputed = match layout.recompute {
        Recompute::Full => 2.0,
        // Its reduce-scatters are kept, its all-gathers (half an all-reduce each) run again.
        Recompute::EverySecondMatmul if layout.sp => 1.0,
        Recompute::EverySecondMatmul => 2.0,
        _ => 0.0,
    };
    // Overlapped (async TP, which needs sequence parallelism's all-gathers and
    // reduce-scatters, and a device computing on its own), each collective runs behind the
    // product it is fused with: attention's all-gather behind the query, key and value
    // product, its reduce-scatter behind the output projection, the MLP's behind its products
    // into and out of the wide layer. Backward, the incoming gradient is gathered once before
    // the output projection's two products (and the MLP's out of the wide layer), and the
    // first product's two run behind the reduce-scatter of its input's gradient and the
    // gather of its input again. A mixture's are taken as a dense MLP's, which is optimistic:
    // only the router reads the gathered tokens, the experts their dispatched copies.
    let (forward_tp, layer_tp) =
        match engine.overlap_tp && layout.sp && cluster.shared_cores.is_none() {
            false => (pair, pair * (1.0 + backward_share + recomputed / 2.0)),
            true => {
                let (a, m) = (attention_ar / 2.0, mlp_ar / 2.0);
                let forward = engine.behind(a, qkv)
                    + engine.behind(a, out)
                    + engine.behind(m, router + mlp_up)
                    + engine.behind(m, mlp_down);
                let backward = engine.behind(2.0 * a, 2.0 * qkv)
                    + engine.behind(a, 2.0 * out)
                    + engine.behind(2.0 * m, 2.0 * (router + mlp_up))
                    + engine.behind(m, 2.0 * mlp_down);
                let recompute = match layout.recompute {
                    Recompute::Full => forward,
                    // The all-gathers run again, each before the one product recomputed after
                    // it: the keys, and a gated MLP's one of its two into the wide layer (a
                    // plain MLP keeps that product, and its gather is waited for).
                    Recompute::EverySecondMatmul => {
                        let after = if shape.gated { mlp_matrix } else { 0.0 };
                        engine.behind(a, keys) + engine.behind(m, after)
                    }
                    Recompute::None | Recompute::Selective => 0.0,
                };
                (forward, forward + backward + recompute)
            }
        };

    let layer_cp = cp_forward
        + cp_backward
        + match layout.recompute {
            Recompute::Full | Recompute::Selective => cp_forward,
            Recompute::None | Recompute::EverySecondMatmul => 0.0,
        };

    // Expert parallelism: the copies go to their experts' ranks and come back (two
    // all-to-alls), mirrored backward and again in a recomputed forward; waited for. Across
    // machines each device's copies leave through its own network interface.
    let ep_forward = match shape.experts {
        Some(_) if layout.ep > 1 => {
            let link = layout.link(
                cluster,
                Dims {
                    ep: true,
                    ..Dims::NONE
                },
            );
            2.0 * link.all_gather(tokens * copies * h * p, layout.ep)
        }
        _ => 0.0,
    };
    let layer_ep = ep_forward
        * match layout.recompute {
            Recompute::Full => 3.0,
            _ => 2.0,
        };

    let layers = shape.layers.div_ceil(layout.pp) as f64;
    // burn-zero's stage 3 runs every block but the last forward again, its collectives too.
    let rerun = if engine.zero3_forward_twice && layout.zero == ZeroStage::Parameters {
        (layers - 1.0).max(0.0)
    } else {
        0.0
    };
    let head_forward = cluster.matmul(1.0, tokens, shape.vocab / t, h)
        + cluster.stream(engine.elementwise_passes * 3.0 * 4.0 * tokens * shape.vocab / t);
    MicroBatch {
        forward: layers * (layer_forward + forward_tp + cp_forward + ep_forward),
        backward: layers * (layer_backward + layer_recompute + layer_tp - forward_tp)
            + layers * (layer_cp - cp_forward + layer_ep - ep_forward)
            + rerun * (layer_forward + forward_tp + cp_forward + ep_forward),
        tp_comm: layers * layer_tp + rerun * forward_tp,
        cp_comm: layers * layer_cp + rerun * cp_forward,
        ep_comm: layers * layer_ep + rerun * ep_forward,
        head: 3.0 * head_forward,
    }
}

/// The data-parallel communication a step waits for and its optimizer step, in seconds.
fn data_parallel(
    shape: &Shape,
    cluster: &Cluster,
    engine: &Engine,
    layout: &StepLayout,
    micro: &MicroBatch,
) -> (f64, f64) {
    let held = shape.held(layout.tp, layout.pp, layout.ep);
    // Gradients are averaged, and ZeRO shards, over the ranks holding the same parameters:
    // the dense ones over dp x ep x cp, the experts over dp x cp.
    let within = Dims {
        dp: true,
        cp: true,
        ..Dims::NONE
    };
    let replicas = layout.dp * layout.cp;
    let groups = match layout.ep {
        1 => vec![(held.dense + held.experts, replicas, within)],
        ep => vec![
            (held.dense, replicas * ep, Dims { ep: true, ..within }),
            (held.experts, replicas, within),
        ],
    };
    let m = layout.micro_batches as f64;
    // Per group: the gradients' reduction, the stepped weights' gather (ZeRO-1/2), and
    // ZeRO-3's gathers and reduce-scatter of one micro-batch.
    let (mut reduce, mut gather, mut per_micro, mut optimizer_state) = (0.0, 0.0, 0.0, 0.0);
    for (params, ranks, dims) in groups.into_iter().filter(|(params, ..)| *params > 0.0) {
        let link = layout.ring(cluster, dims);
        let (grads, weights) = (params * engine.grad_bytes, params * engine.compute_bytes);
        match layout.zero {
            ZeroStage::Replicated => {
                reduce += link.all_reduce(grads, ranks);
                optimizer_state += params;
            }
            // ZeRO-1/2 reduce-scatter (half an all-reduce) and gather the stepped weights.
            ZeroStage::OptimizerState | ZeroStage::Gradients => {
                reduce += link.all_gather(grads, ranks);
                gather += link.all_gather(weights, ranks);
                optimizer_state += params / ranks as f64;
            }
            ZeroStage::Parameters => {
                per_micro += 2.0 * link.all_gather(weights, ranks) + link.all_gather(grads, ranks);
                optimizer_state += params / ranks as f64;
            }
        }
    }
    let dp_comm = match layout.zero {
        ZeroStage::Parameters => {
            // Every micro-batch gathers the weights for forward and again for backward and
            // reduce-scatters their gradients, prefetched behind its computation.
            match cluster.shared_cores {
                Some(_) => m * per_micro,
                None => m * engine.behind(per_micro, micro.forward + micro.backward),
            }
        }
        _ => {
            let overlaps = engine.overlap_grad_reduce && cluster.shared_cores.is_none();
            let exposed = if overlaps {
                engine.behind(reduce, micro.backward)
            } else {
                reduce
            };
            exposed + gather
        }
    };
    // Adam reads the gradient, weight and both moments and writes the three back (fp32),
    // and casts the updated weight to the compute dtype.
    let bytes_per_param = 28.0 + if engine.compute_bytes < 4.0 { 6.0 } else { 0.0 };
    let optimizer = cluster.stream(optimizer_state * bytes_per_param);
    (dp_comm, optimizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dp: usize, tp: usize, pp: usize, schedule: ScheduleKind, v: usize) -> StepLayout {
        StepLayout {
            tp,
            pp,
            sp: tp > 1,
            zero: ZeroStage::OptimizerState,
            schedule,
            virtual_stages: v,
            ..StepLayout::data_parallel(dp, 1, 8, 2048)
        }
    }

    fn engine() -> Engine {
        crate::planner::burn_parallel(true)
    }

    fn burn_parallel_f32() -> Engine {
        crate::planner::burn_parallel(false)
    }

    #[test]
    fn the_parts_sum_to_the_step_and_none_is_negative() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let gpus = Cluster::preset("a100", 2).unwrap();
        let threads = Cluster {
            shared_cores: Some(2),
            ..Cluster::preset("a100", 1).unwrap()
        };
        let layouts = [
            layout(16, 1, 1, ScheduleKind::OneFOneB, 1),
            layout(2, 8, 1, ScheduleKind::OneFOneB, 1),
            layout(2, 2, 4, ScheduleKind::OneFOneB, 1),
            layout(1, 4, 4, ScheduleKind::Interleaved, 2),
            layout(2, 1, 8, ScheduleKind::ZeroBubbleH1, 1),
            StepLayout {
                zero: ZeroStage::Parameters,
                ..layout(16, 1, 1, ScheduleKind::OneFOneB, 1)
            },
            StepLayout {
                cp: 2,
                cp_attention: CpAttention::AllGather,
                ..layout(2, 2, 2, ScheduleKind::OneFOneB, 1)
            },
        ];
        for (cluster, layout) in layouts.iter().map(|l| (&gpus, *l)).chain([
            (&threads, layout(1, 2, 2, ScheduleKind::OneFOneB, 1)),
            (
                &threads,
                StepLayout {
                    cp: 2,
                    ..layout(1, 1, 1, ScheduleKind::OneFOneB, 1)
                },
            ),
        ]) {
            let step = step_time(&shape, cluster, &engine(), &layout).unwrap();
            let sum: f64 = step.parts().iter().map(|(_, s)| s).sum();
            assert!(
                (sum - step.total).abs() <= 1e-9 * step.total,
                "{layout:?}: {step:?}"
            );
            assert!(
                step.parts().iter().all(|(_, s)| *s >= 0.0),
                "{layout:?}: {step:?}"
            );
        }
        // Four thread ranks on two cores wait for them: the step is longer than the
        // pipeline's alone, the wait counted as bubble.
        let alone = Cluster {
            shared_cores: None,
            ..threads.clone()
        };
        let shared = layout(1, 2, 2, ScheduleKind::OneFOneB, 1);
        let (waiting, free) = (
            step_time(&shape, &threads, &engine(), &shared).unwrap(),
            step_time(&shape, &alone, &engine(), &shared).unwrap(),
        );
        assert!(waiting.total > 1.5 * free.total && waiting.bubble > free.bubble);
    }

    #[test]
    fn burn_zeros_stage_3_computes_every_blocks_forward_twice() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let cluster = Cluster::preset("a100", 2).unwrap();
        let stage = |zero, twice| {
            let layout = StepLayout {
                zero,
                ..layout(8, 2, 1, ScheduleKind::OneFOneB, 1)
            };
            let engine = Engine {
                zero3_forward_twice: twice,
                ..engine()
            };
            micro_batch(&shape, &cluster, &engine, &layout)
        };
        let once = stage(ZeroStage::Parameters, false);
        let twice = stage(ZeroStage::Parameters, true);
        assert_eq!(twice.forward, once.forward);
        // Every block but the last, with its tensor-parallel all-reduces.
        let again = once.forward * (shape.layers - 1) as f64 / shape.layers as f64;
        assert!((twice.backward - once.backward - again).abs() < 1e-12 * once.backward);
        assert!(twice.tp_comm > once.tp_comm);
        // Only stage 3 gathers weights per unit and runs the forward again.
        let first = stage(ZeroStage::OptimizerState, true);
        assert_eq!(first.backward, once.backward);
    }

    /// `cluster` with its links within a node `factor` times faster, in bandwidth and latency.
    fn links_faster(cluster: &Cluster, factor: f64) -> Cluster {
        Cluster {
            intra_node: Link {
                bandwidth: cluster.intra_node.bandwidth * factor,
                latency: cluster.intra_node.latency / factor,
            },
            ..cluster.clone()
        }
    }

    #[test]
    fn overlapped_tensor_parallel_collectives_pay_what_their_products_do_not_hide() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let nvlink = Cluster::preset("a100", 1).unwrap();
        let on = |cluster: &Cluster, overlap_tp, overlap_cost| {
            let engine = Engine {
                overlap_tp,
                overlap_cost,
                ..engine()
            };
            let layout = layout(1, 8, 1, ScheduleKind::OneFOneB, 1);
            micro_batch(&shape, cluster, &engine, &layout)
        };
        // Over a link fast enough, every collective is shorter than its product: hidden
        // entirely, or paying the engine's share of what it overlaps.
        let fast = links_faster(&nvlink, 100.0);
        let waited = on(&fast, false, 0.0).tp_comm;
        assert!(waited > 0.0);
        assert_eq!(on(&fast, true, 0.0).tp_comm, 0.0);
        let share = on(&fast, true, 0.25).tp_comm;
        assert!((share - 0.25 * waited).abs() < 1e-12 * waited);
        // Over NVLink a forward's products outlast its collectives together, but the
        // reduce-scatters outlast their single products: they are partly waited for.
        let (a100, gathered) = (on(&nvlink, true, 0.0), on(&nvlink, false, 0.0));
        assert!(a100.tp_comm > 0.0 && a100.tp_comm < gathered.tp_comm);
        // Over a slow link every collective outlasts its product, and the rest is waited for.
        let slow = links_faster(&nvlink, 1e-3);
        let (hidden, waited) = (on(&slow, true, 0.0), on(&slow, false, 0.0));
        assert!(hidden.tp_comm > 0.0 && hidden.tp_comm < waited.tp_comm);
        // The products themselves take as long either way.
        let compute = |m: &MicroBatch| m.forward + m.backward - m.tp_comm;
        assert!((compute(&hidden) - compute(&waited)).abs() < 1e-9 * compute(&waited));
        // Without sequence parallelism the collectives are all-reduces, which async TP does
        // not overlap.
        let all_reduces = |overlap_tp| {
            let engine = Engine {
                overlap_tp,
                ..engine()
            };
            let layout = StepLayout {
                sp: false,
                ..layout(1, 8, 1, ScheduleKind::OneFOneB, 1)
            };
            micro_batch(&shape, &slow, &engine, &layout).tp_comm
        };
        assert_eq!(all_reduces(true), all_reduces(false));
    }

    #[test]
    fn a_recompute_of_fewer_products_hides_less_of_its_collectives() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        // A link slow enough that every collective outlasts its product.
        let slow = links_faster(&Cluster::preset("a100", 1).unwrap(), 1e-3);
        let paid = |overlap_tp, recompute| {
            let engine = Engine {
                overlap_tp,
                ..engine()
            };
            let layout = StepLayout {
                recompute,
                ..layout(1, 8, 1, ScheduleKind::OneFOneB, 1)
            };
            micro_batch(&shape, &slow, &engine, &layout).tp_comm
        };
        // What overlapping hides, beyond what it hides without recompute.
        let hidden = |recompute| {
            let none = paid(false, Recompute::None) - paid(true, Recompute::None);
            paid(false, recompute) - paid(true, recompute) - none
        };
        // A recomputed forward's all-gathers hide behind the products run again after them:
        // every product under full recompute, the keys and one MLP matrix per op.
        let (per_op, full) = (
            hidden(Recompute::EverySecondMatmul),
            hidden(Recompute::Full),
        );
        assert!(per_op > 0.0 && per_op < full, "{per_op} {full}");
    }

    #[test]
    fn flash_attentions_backward_makes_five_products_to_its_forwards_two() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let cluster = Cluster::preset("h100", 1).unwrap();
        let at = |efficiency| {
            let engine = Engine {
                flash_attention: Some(efficiency),
                ..engine()
            };
            micro_batch(
                &shape,
                &cluster,
                &engine,
                &layout(8, 1, 1, ScheduleKind::OneFOneB, 1),
            )
        };
        let (slow, fast) = (at(0.35), at(0.7));
        // Only attention's time depends on the kernel's rate.
        let forward = slow.forward - fast.forward;
        assert!(forward > 0.0);
        let backward = slow.backward - fast.backward;
        assert!(
            (backward - 2.5 * forward).abs() < 1e-9 * backward,
            "{backward} {forward}"
        );
    }

    #[test]
    fn per_op_checkpointing_recomputes_more_than_attention_and_less_than_the_block() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let cluster = Cluster::preset("h100", 1).unwrap();
        let engine = Engine {
            flash_attention: Some(0.35),
            ..engine()
        };
        let run = |recompute| {
            let layout = StepLayout {
                recompute,
                ..layout(1, 8, 1, ScheduleKind::OneFOneB, 1)
            };
            micro_batch(&shape, &cluster, &engine, &layout)
        };
        let none = run(Recompute::None);
        let [selective, per_op, full] = [
            Recompute::Selective,
            Recompute::EverySecondMatmul,
            Recompute::Full,
        ]
        .map(|r| run(r).backward - none.backward);
        assert!(0.0 < selective && selective < per_op && per_op < full);
        // Under sp it keeps the reduce-scatters and gathers again: half a whole forward's.
        let comm = |r| run(r).tp_comm - none.tp_comm;
        let (per_op, full) = (comm(Recompute::EverySecondMatmul), comm(Recompute::Full));
        assert!(per_op > 0.0 && (per_op - full / 2.0).abs() < 1e-12 * full);
    }

    #[test]
    fn context_parallel_ranks_share_the_tokens_and_the_ring_skips_masked_chunk_pairs() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let cluster = Cluster::preset("a100", 1).unwrap();
        let cut = |dp, cp, cp_attention| StepLayout {
            cp,
            cp_attention,
            seq_len: 16384,
            ..layout(dp, 1, 1, ScheduleKind::OneFOneB, 1)
        };
        let run = |cluster: &Cluster, cp, attention| {
            micro_batch(&shape, cluster, &engine(), &cut(1, cp, attention))
        };
        let whole = run(&cluster, 1, CpAttention::Ring);
        let ring = run(&cluster, 2, CpAttention::Ring);
        let gathered = run(&cluster, 2, CpAttention::AllGather);
        // burn's attention computes every score under the mask; the ring computes 5 of the
        // 16 pairs of 4 chunks on each rank, all-gather half the scores.
        assert!(ring.forward < whole.forward / 2.0 && gathered.forward > whole.forward / 2.0);
        assert!(gathered.forward > ring.forward);
        // A GPU passes the ring's keys behind its scores, but waits for their gradients;
        // all-gather waits for both, thread ranks for everything.
        assert_eq!(whole.cp_comm, 0.0);
        assert!(ring.cp_comm > 0.0 && gathered.cp_comm > 0.0);
        let threads = Cluster {
            shared_cores: Some(2),
            ..cluster.clone()
        };
        assert!(run(&threads, 2, CpAttention::Ring).cp_comm > ring.cp_comm);
        // Gradients are averaged, and ZeRO shards, over dp x cp.
        let optimizer = |dp, cp| {
            step_time(&shape, &cluster, &engine(), &cut(dp, cp, CpAttention::Ring))
                .unwrap()
                .optimizer
        };
        assert_eq!(optimizer(2, 2), optimizer(4, 1));
        assert!(optimizer(2, 2) < optimizer(2, 1));
    }

    #[test]
    fn context_parallel_gradients_cross_nodes_only_where_the_ranks_do() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let mut cluster = Cluster::preset("a100", 2).unwrap();
        cluster.inter_node.bandwidth = 1e6;
        let dp_comm = |tp, cp, pp| {
            let layout = StepLayout {
                cp,
                zero: ZeroStage::Replicated,
                ..layout(16 / (tp * cp * pp), tp, pp, ScheduleKind::OneFOneB, 1)
            };
            step_time(&shape, &cluster, &engine(), &layout)
                .unwrap()
                .dp_comm
        };
        // tp 4 x cp 2: the cp peers are 4 apart, in one node (pp 2 puts the stages on the
        // other); tp 8 x cp 2: 8 apart, across the nodes.
        assert!(dp_comm(8, 2, 1) > 100.0 * dp_comm(4, 2, 2));
    }

    #[test]
    fn a_mixtures_shape_counts_its_parameters_and_a_tokens_flops_by_its_experts() {
        for name in ["small", "small-moe", "llama-7b"] {
            let model = LlamaConfig::preset(name).unwrap();
            let shape = Shape::llama(&model);
            assert_eq!(shape.params(), model.num_params() as f64, "{name}");
            assert_eq!(shape.experts.is_some(), model.is_moe());
            // 6 per weight a token multiplies by: its experts', not the embedding's or norms'.
            let (h, l) = (model.hidden_size, model.num_hidden_layers);
            let weights = model.num_active_params() - model.vocab_size * h - 2 * h * l - h;
            let attention = 12.0 * (l * h * 64) as f64;
            let flops = shape.model_flops_per_token(64) - attention;
            assert_eq!(flops, 6.0 * weights as f64, "{name}");
        }
    }

    #[test]
    fn expert_parallel_ranks_hold_their_experts_and_exchange_the_copies() {
        let model = LlamaConfig::preset("small-moe").unwrap();
        let shape = Shape::llama(&model);
        let cluster = Cluster::preset("a100", 1).unwrap();
        let engine = burn_parallel_f32();
        let cut = |ep| StepLayout {
            ep,
            zero: ZeroStage::Replicated,
            ..layout(1, 1, 1, ScheduleKind::OneFOneB, 1)
        };
        let (one, two) = (shape.held(1, 1, 1), shape.held(1, 1, 2));
        assert_eq!((two.dense, two.experts), (one.dense, one.experts / 2.0));
        let single = micro_batch(&shape, &cluster, &engine, &cut(1));
        let split = micro_batch(&shape, &cluster, &engine, &cut(2));
        assert_eq!(single.ep_comm, 0.0);
        // Each of 8 blocks sends its token copies (2 per token, 512 wide, fp32) to their
        // experts and back, and their gradients back and forth.
        let copies = 2048.0 * 2.0 * 512.0 * 4.0;
        let link = cluster.link(2, 1);
        let expected = 8.0 * 4.0 * link.all_gather(copies, 2);
        assert!(
            (split.ep_comm - expected).abs() < 1e-12,
            "{}",
            split.ep_comm
        );
        // Half the experts each, on twice the rows: the same products, larger (the forward
        // holds half the all-to-alls), and half the experts to step.
        assert!(split.forward - split.ep_comm / 2.0 <= single.forward);
        let step = |ep| step_time(&shape, &cluster, &engine, &cut(ep)).unwrap();
        assert!(step(2).optimizer < step(1).optimizer);
        // Under tp every rank keeps the whole router (8 blocks of 8 x 512)...
        let routers = 8.0 * 8.0 * 512.0;
        let halved = shape.held(2, 1, 1).dense - shape.held(1, 1, 1).dense / 2.0;
        assert!((halved - routers / 2.0).abs() < 1e-6, "{halved}");
        // ...and all-reduces the experts' outputs, a row per copy: twice attention's rows.
        let at_tp = |shape: &Shape| {
            let layout = StepLayout {
                sp: false,
                ..cut(1)
            };
            let layout = StepLayout { tp: 2, ..layout };
            micro_batch(shape, &cluster, &engine, &layout).tp_comm
        };
        let dense = Shape {
            experts: None,
            ..shape
        };
        let link = cluster.link(1, 2);
        let rows = |copies: f64| link.all_reduce(2048.0 * copies * 512.0 * 4.0, 2);
        let expected = (rows(1.0) + rows(2.0)) / (2.0 * rows(1.0));
        let ratio = at_tp(&shape) / at_tp(&dense);
        assert!(
            (ratio - expected).abs() < 1e-9,
            "{ratio} against {expected}"
        );
    }

    #[test]
    fn a_collective_across_machines_moves_through_every_network_interface_its_ranks_have() {
        let cluster = Cluster::preset("a100", 2).unwrap();
        let dp = Dims {
            dp: true,
            ..Dims::NONE
        };
        let (nic, nvlink) = (cluster.inter_node.bandwidth, cluster.intra_node.bandwidth);
        let ring = |dp_size, tp| {
            let layout = layout(dp_size, tp, 1, ScheduleKind::OneFOneB, 1);
            (
                layout.ranks_per_node(&cluster, dp),
                layout.ring(&cluster, dp).bandwidth,
                layout.link(&cluster, dp).bandwidth,
            )
        };
        // One rank a machine: its own interface; two: two; eight: the machine's eight, as
        // far as the links within it carry. A message between two ranks leaves through one.
        assert_eq!(ring(2, 8), (1, nic, nic));
        assert_eq!(ring(4, 4), (2, 2.0 * nic, nic));
        assert_eq!(ring(16, 1), (8, (8.0 * nic).min(nvlink), nic));
        // Within one machine: its own links.
        assert_eq!(ring(8, 1).1, nvlink);
        // Sizes that do not divide a machine: three machines of 8 devices.
        let three = Cluster::preset("a100", 3).unwrap();
        let cp = Dims {
            cp: true,
            ..Dims::NONE
        };
        let per_node = |dp, cp_size, tp, dims| {
            let layout = StepLayout {
                cp: cp_size,
                ..layout(dp, tp, 1, ScheduleKind::OneFOneB, 1)
            };
            layout.ranks_per_node(&three, dims)
        };
        // cp 3 over tp 2: the group {6, 8, 10} has one rank in the first machine.
        assert_eq!(per_node(4, 3, 2, cp), 1);
        // dp 8 x cp 3 over all 24 devices: eight in every machine.
        let dp_cp = Dims { dp: true, ..cp };
        assert_eq!(per_node(8, 3, 1, dp_cp), 8);
    }

    #[test]
    fn a_pipeline_whose_stages_span_nodes_sends_over_the_slower_link() {
        let shape = Shape::llama(&LlamaConfig::preset("llama-7b").unwrap());
        let mut cluster = Cluster::preset("a100", 2).unwrap();
        cluster.inter_node.bandwidth = 1e6;
        let bubble = |tp, pp| {
            let layout = layout(16 / (tp * pp), tp, pp, ScheduleKind::OneFOneB, 1);
            step_time(&shape, &cluster, &engine(), &layout)
                .unwrap()
                .bubble
        };
        // tp 2 x pp 4 fits in a node of 8; tp 4 x pp 4 spans two.
        assert!(bubble(4, 4) > 100.0 * bubble(2, 4));
    }

    #[test]
    fn key_value_heads_copied_over_tensor_parallel_ranks_are_held_by_each() {
        let shape = Shape::llama(&LlamaConfig::preset("llama3-8b").unwrap());
        // 8 key/value heads: split over 8 ranks, copied (each rank one head) over 16.
        assert_eq!(shape.held(8, 1, 1).dense, shape.params() / 8.0);
        let copies = 32.0 * 2.0 * 4096.0 * (128.0 - 1024.0 / 16.0);
        let held = shape.held(16, 1, 1).dense;
        assert!(
            (held - (shape.params() / 16.0 + copies)).abs() < 1.0,
            "{held}"
        );
    }
}
