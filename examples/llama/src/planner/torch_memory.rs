//! The device memory a PyTorch training step reserves at its peak, as torchtitan trains a
//! Llama model with FSDP2: what eager PyTorch keeps for the backward, where FSDP2 allocates,
//! and the caching allocator's pools, one for each CUDA stream that allocates. It is a model
//! of its own, beside `llama plan`'s estimate of burn's runs (`plan::run_bytes`, from what
//! burn's autodiff keeps, checked against this repository's runs): published runs of PyTorch
//! can be checked only against a model of what PyTorch holds (`tests/planner_validation.rs`).
//!
//! The run it describes (torchtitan at the end of 2024, `parallelize_llama.py` and `train.py`,
//! on a PyTorch nightly of 2024-12-23, 1963fc8; its FSDP2 was read in the 2.6.0 release):
//! every block and the root module (embedding, final norm, head)
//! `fully_shard`ed over the data-parallel ranks, parameters kept in fp32 and gathered in bf16,
//! gradients reduced in fp32, AdamW with `foreach` kernels, gradients set to `None` before each
//! step, and the loss `cross_entropy(logits.float())` on the whole vocabulary. The allocator
//! runs with expandable segments (`run_llama_train.sh`): one segment per stream that grows,
//! a freed range taken again only by an allocation no larger.

use super::step_time::{Recompute, Shape};

const BF16: f64 = 2.0;
const FP32: f64 = 4.0;

/// A torchtitan run of FSDP alone (no tensor, pipeline or context parallelism), in eager mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FsdpRun {
    /// The model.
    pub shape: Shape,
    /// Ranks the parameters, gradients and optimizer state are sharded over.
    pub shards: usize,
    /// Samples per rank and step.
    pub local_batch: usize,
    /// Tokens per sample.
    pub seq_len: usize,
    /// What the blocks' checkpointing keeps: everything (`None`), torchtitan's per-op policy
    /// (`EverySecondMatmul`) or each block's input (`Full`).
    pub recompute: Recompute,
}

/// Bytes the caching allocator reserves at a step's peak, by pool and, in the default
/// stream's pool, by what holds them at the moment it peaks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TorchMemory {
    /// The fp32 parameter shards and AdamW's two moments.
    pub model_state: f64,
    /// At the peak: parameter groups gathered whole in bf16, gradients not yet reduced, and
    /// a reduce-scatter's fp32 input.
    pub gathered: f64,
    /// What the backward keeps of the blocks and the head, at the peak.
    pub activations: f64,
    /// The working set of the moment of the peak (the loss's backward, a block's, or the
    /// optimizer's step; none at the root's reduction), with, in the loss's, the free range
    /// its forward leaves too small for it.
    pub transient: f64,
    /// The all-gathers' pool (their copy-in stream's): the root's output, kept until the
    /// first block's is waited for, that block's, and the range the root's bf16 shard (its
    /// input) leaves, which the block's output does not fit in.
    pub gather_pool: f64,
    /// The reduce-scatters' pool: their outputs, which the fp32 gradient shards are views of.
    pub reduce_pool: f64,
}

impl TorchMemory {
    /// Everything reserved: the pools do not lend to each other.
    pub fn reserved(&self) -> f64 {
        self.model_state
            + self.gathered
            + self.activations
            + self.transient
            + self.gather_pool
            + self.reduce_pool
    }
}

/// What the default stream's pool holds beside the model state at one moment of a step.
#[derive(Debug, Clone, Copy)]
struct Moment {
    gathered: f64,
    activations: f64,
    transient: f64,
}

impl Moment {
    fn total(&self) -> f64 {
        self.gathered + self.activations + self.transient
    }
}

/// The peak memory reserved on each device by one step of `run`.
///
/// The default stream's pool peaks at the largest of five moments:
/// - the loss's backward: every block's kept activations, the final norm's, and three fp32
///   copies of the logits (the log-softmax the loss keeps, its gradient, and the gradient of
///   its input), with the root and the last block gathered (neither is resharded after its
///   forward). The forward's end holds less, but leaves the bf16 logits and their fp32 copy
///   freed side by side: the first gradient takes the fp32 copy's size of that range, and the
///   second, finding no range as large, extends the segment, so the logits' size is reserved
///   unused;
/// - the last block's backward: the other blocks' kept activations, this block's whole
///   (recomputed, with its kept input under checkpointing) and three MLP-wide gradients at
///   once (the product's, and from it the SiLU's and the up projection's; the product itself
///   freed by then), gathered with the block before it (prefetched) and the root, and the
///   unreduced bf16 gradients of the MLP's output matrix and of the head (the root group is
///   reduced last);
/// - the backward of the block before it: one block's activations fewer, the last block's
///   fp32 reduce-scatter input more (FSDP2 frees it at the next group's reduction);
/// - the root's reduction, at the backward's end: its bf16 gradients and their fp32 copy to
///   be reduced (its parameters are resharded and the first block's reduce-scatter input
///   freed just before; the free ranges they leave are not counted);
/// - the optimizer's step: AdamW's `foreach` kernels' square root of the second moment.
pub fn fsdp_peak_memory(run: &FsdpRun) -> Result<TorchMemory, String> {
    let shape = &run.shape;
    if shape.experts.is_some() {
        return Err("the PyTorch memory model covers dense Llama models, not mixtures".into());
    }
    if !shape.gated {
        return Err("the PyTorch memory model covers Llama's gated MLP only".into());
    }
    if run.shards == 0 || run.local_batch == 0 || run.seq_len == 0 {
        return Err(format!(
            "shards ({}), local batch ({}) and sequence length ({}) must be positive",
            run.shards, run.local_batch, run.seq_len
        ));
    }
    if shape.layers < 2 {
        return Err(format!(
            "the PyTorch memory model needs at least two blocks, not {}",
            shape.layers
        ));
    }
    let (h, f, v, a) = (shape.hidden, shape.ffn, shape.vocab, shape.heads);
    let kv = shape.kv_heads * shape.head_dim();
    let tokens = (run.local_batch * run.seq_len) as f64;
    let layers = shape.layers as f64;
    let shards = run.shards as f64;

    let params = shape.params();
    let block = shape.block_params();
    let root = params - layers * block;

    // Per token, what eager PyTorch keeps of one block when nothing is recomputed: each
    // RMSNorm its fp32 input, its normed value and its output; attention the rotated queries,
    // the keys and values repeated for every query head, and FlashAttention's output (which
    // the projection reads as it is: made contiguous, FlashAttention's layout needs no copy)
    // and log-sum-exp (RoPE's fp32 products keep only the table); the MLP its gate, the
    // gate's SiLU, the up projection and their product.
    let norm = (FP32 + BF16 + BF16) * h;
    let whole_block = 2.0 * norm + BF16 * 4.0 * h + FP32 * a + BF16 * 4.0 * f;
    // Under checkpointing, what a block keeps includes its input, which its recompute reads.
    let (kept_block, input) = match run.recompute {
        Recompute::None => (whole_block, 0.0),
        // The input, and the outputs the policy saves: the 1st, 3rd, 5th and 7th products
        // (queries, values, the gate, the MLP's output) and FlashAttention's.
        Recompute::EverySecondMatmul => {
            let products = h + kv + f + h;
            (BF16 * (h + products + h) + FP32 * a, BF16 * h)
        }
        Recompute::Full => (BF16 * h, BF16 * h),
        Recompute::Selective => {
            return Err(
                "torchtitan has no selective recompute of attention alone; use \
                 EverySecondMatmul (its per-op policy) or Full"
                    .into(),
            );
        }
    };
    let recomputed_block = whole_block + input;

    let loss = Moment {
        gathered: BF16 * (root + block),
        // The final norm keeps what each of a block's norms keeps.
        activations: tokens * (layers * kept_block + norm),
        transient: tokens * (3.0 * FP32 * v + BF16 * v),
    };
    // In a block's backward: the root, this block and the one before it gathered, the
    // gradients of the MLP's output matrix and of the head unreduced; three MLP-wide
    // gradients, less the product they free.
    let in_a_block = BF16 * (root + 2.0 * block) + BF16 * (h * f + v * h);
    let block_working_set = tokens * BF16 * (3.0 * f - f);
    let last_block = Moment {
        gathered: in_a_block,
        activations: tokens * ((layers - 1.0) * kept_block + recomputed_block),
        transient: block_working_set,
    };
    let block_before = Moment {
        gathered: in_a_block + FP32 * block,
        activations: tokens * ((layers - 2.0) * kept_block + recomputed_block),
        transient: block_working_set,
    };
    let root_reduction = Moment {
        gathered: (BF16 + FP32) * root,
        activations: 0.0,
        transient: 0.0,
    };
    let optimizer = Moment {
        gathered: 0.0,
        activations: 0.0,
        transient: FP32 * params / shards,
    };
    let peak = [loss, last_block, block_before, root_reduction, optimizer]
        .into_iter()
        .max_by(|x, y| x.total().total_cmp(&y.total()))
        .expect("five moments");

    Ok(TorchMemory {
        model_state: (FP32 + 2.0 * FP32) * params / shards,
        gathered: peak.gathered,
        activations: peak.activations,
        transient: peak.transient,
        gather_pool: BF16 * (root + block + root / shards),
        reduce_pool: FP32 * params / shards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LlamaConfig;

    fn llama_8b() -> Shape {
        Shape::llama(&LlamaConfig::preset("llama3-8b").unwrap())
    }

    fn run(shards: usize, recompute: Recompute) -> FsdpRun {
        FsdpRun {
            shape: llama_8b(),
            shards,
            local_batch: 2,
            seq_len: 8192,
            recompute,
        }
    }

    #[test]
    fn the_per_op_policy_keeps_the_input_four_products_and_attention() {
        let per_op = fsdp_peak_memory(&run(8, Recompute::EverySecondMatmul)).unwrap();
        let full = fsdp_peak_memory(&run(8, Recompute::Full)).unwrap();
        // Both peak in the loss's backward, which differs only in the blocks kept.
        let tokens = 16_384.0;
        // Beyond the input: queries, values, gate, MLP output, attention's output and
        // log-sum-exp.
        let more = (4096.0 + 1024.0 + 14_336.0 + 4096.0 + 4096.0) * 2.0 + 32.0 * 4.0;
        assert_eq!(per_op.activations - full.activations, 32.0 * tokens * more);
        assert_eq!(per_op.transient, tokens * 14.0 * 128_256.0);
    }

    #[test]
    fn sharding_divides_only_what_is_held_in_shards() {
        let (a, b) = (
            fsdp_peak_memory(&run(8, Recompute::EverySecondMatmul)).unwrap(),
            fsdp_peak_memory(&run(128, Recompute::EverySecondMatmul)).unwrap(),
        );
        let shape = llama_8b();
        let root = shape.params() - 32.0 * shape.block_params();
        // fp32 parameters, gradients and moments, and the root's bf16 shard copied in to be
        // gathered.
        let per_shard = 16.0 * shape.params() + 2.0 * root;
        let sharded = per_shard * (1.0 / 8.0 - 1.0 / 128.0);
        assert!((a.reserved() - b.reserved() - sharded).abs() < 1.0);
        assert_eq!(
            (a.gathered, a.activations, a.transient),
            (b.gathered, b.activations, b.transient)
        );
    }

    #[test]
    fn without_the_logits_a_block_s_backward_is_the_peak() {
        // A small vocabulary: a block's backward outweighs the loss's, and the one before the
        // last, holding the last one's reduce-scatter input, outweighs the last's (whose one
        // more kept input is smaller).
        let shape = Shape {
            vocab: 1000.0,
            ..llama_8b()
        };
        let memory = fsdp_peak_memory(&FsdpRun {
            shape,
            ..run(8, Recompute::Full)
        })
        .unwrap();
        let root = shape.params() - 32.0 * shape.block_params();
        let gathered = 2.0 * (root + 2.0 * shape.block_params())
            + 2.0 * (4096.0 * 14_336.0 + 1000.0 * 4096.0)
            + 4.0 * shape.block_params();
        assert_eq!(memory.gathered, gathered);
        assert_eq!(memory.transient, 16_384.0 * 2.0 * 2.0 * 14_336.0);
    }

    #[test]
    fn without_checkpointing_every_block_keeps_all_it_computed() {
        let memory = fsdp_peak_memory(&run(8, Recompute::None)).unwrap();
        // Per token: two norms' fp32 input, normed value and output; queries, repeated keys
        // and values, attention's output; its log-sum-exp; gate, SiLU, up projection, product.
        let block = 2.0 * (4.0 + 2.0 + 2.0) * 4096.0
            + 4.0 * 2.0 * 4096.0
            + 32.0 * 4.0
            + 4.0 * 2.0 * 14_336.0;
        let final_norm = 8.0 * 4096.0;
        assert_eq!(memory.activations, 16_384.0 * (32.0 * block + final_norm));
    }

    #[test]
    fn a_few_tokens_peak_at_the_root_s_reduction_or_the_optimizer_s_step() {
        let few = |shards| FsdpRun {
            local_batch: 1,
            seq_len: 16,
            ..run(shards, Recompute::EverySecondMatmul)
        };
        let shape = llama_8b();
        let root = shape.params() - 32.0 * shape.block_params();
        // The root's bf16 gradients and their fp32 copy.
        let reduction = fsdp_peak_memory(&few(8)).unwrap();
        assert_eq!(
            (
                reduction.gathered,
                reduction.activations,
                reduction.transient
            ),
            (6.0 * root, 0.0, 0.0)
        );
        // Unsharded, the square root of the second moment is larger.
        let step = fsdp_peak_memory(&few(1)).unwrap();
        assert_eq!((step.gathered, step.transient), (0.0, 4.0 * shape.params()));
    }

    #[test]
    fn what_it_does_not_model_is_refused() {
        assert!(fsdp_peak_memory(&run(8, Recompute::Selective)).is_err());
        assert!(fsdp_peak_memory(&run(0, Recompute::Full)).is_err());
        let one_block = FsdpRun {
            shape: Shape {
                layers: 1,
                ..llama_8b()
            },
            ..run(8, Recompute::Full)
        };
        assert!(fsdp_peak_memory(&one_block).is_err());
        let moe = FsdpRun {
            shape: Shape {
                experts: Some(crate::planner::step_time::Experts {
                    count: 8.0,
                    top_k: 2.0,
                }),
                ..llama_8b()
            },
            ..run(8, Recompute::Full)
        };
        assert!(fsdp_peak_memory(&moe).is_err());
    }
}
