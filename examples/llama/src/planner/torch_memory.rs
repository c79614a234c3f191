//! The device memory a PyTorch training step reserves at its peak, as torchtitan trains a
//! Llama model with FSDP2: what eager PyTorch keeps for the backward, where FSDP2 allocates,
//! and the caching allocator's pools, one for each CUDA stream that allocates. `llama plan`
//! sizes burn's runs (`plan::run_bytes`, from what burn's autodiff keeps); this is how the
//! memory side of the planner is held to published runs of another system
//! (`tests/planner_validation.rs`).
//!
//! The run it describes (torchtitan at the end of 2024, `parallelize_llama.py` and `train.py`,
//! on PyTorch 2.6's FSDP2): every block and the root module (embedding, final norm, head)
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
    /// optimizer's step), with the free range the loss's forward leaves too small for it.
    pub transient: f64,
    /// The all-gathers' pool (their copy-in stream's): the root's output, kept until the
    /// first block's is waited for, that block's, and the root's shard copied in.
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

/// The peak memory reserved on each device by one step of `run`.
///
/// The default stream's pool peaks at the largest of four moments:
/// - the loss's backward: every block's kept activations, the final norm's, and three fp32
///   copies of the logits (the log-softmax the loss keeps, its gradient, and the gradient of
///   its input), with the root and the last block gathered (neither is resharded after its
///   forward). The forward's end holds less, but leaves the bf16 logits and their fp32 copy
///   freed side by side: the first gradient takes the fp32 copy's size of that range, and the
///   second, finding no range as large, extends the segment, so the logits' size is reserved
///   unused;
/// - the last block's backward: the other blocks' kept activations, this block's whole
///   (recomputed) and three of its MLP-wide gradients at once, gathered with the block before
///   it (prefetched) and the root, and the unreduced bf16 gradients of this block and of the
///   head (the root group is reduced last, after the embedding's gradient);
/// - the backward of the block before it: one block's activations fewer, the last block's
///   fp32 reduce-scatter input more (FSDP2 frees it at the next group's reduction);
/// - the optimizer's step: AdamW's `foreach` kernels' square root of the second moment.
pub fn fsdp_peak_memory(run: &FsdpRun) -> Result<TorchMemory, String> {
    let shape = &run.shape;
    if shape.experts.is_some() {
        return Err("the PyTorch memory model covers dense Llama models, not mixtures".into());
    }
    if !shape.gated {
        return Err("the PyTorch memory model covers Llama's gated MLP only".into());
    }
    if run.shards == 0 || run.local_batch == 0 || run.seq_len == 0 || shape.layers < 2 {
        return Err(format!(
            "shards ({}), local batch ({}) and sequence length ({}) must be positive, with \
             at least two blocks ({})",
            run.shards, run.local_batch, run.seq_len, shape.layers
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
    // RMSNorm its fp32 input, its normed value and its output (`8h`); attention the rotated
    // queries, the keys and values repeated for every query head, FlashAttention's output and
    // log-sum-exp, and that output made contiguous for the projection (`10h + 4a`; RoPE's
    // fp32 products keep only the table); the MLP its gate, the gate's SiLU, the up
    // projection and their product (`8f`).
    let whole_block = 2.0 * 8.0 * h + 10.0 * h + FP32 * a + 4.0 * BF16 * f;
    let kept_block = match run.recompute {
        Recompute::None => whole_block,
        // The block's input, and the outputs the policy saves: the 1st, 3rd, 5th and 7th
        // products (queries, values, the gate, the MLP's output) and FlashAttention's.
        Recompute::EverySecondMatmul => {
            let products = h + kv + f + h;
            BF16 * (h + products + h) + FP32 * a
        }
        Recompute::Full => BF16 * h,
        Recompute::Selective => {
            return Err(
                "torchtitan has no selective recompute of attention alone; use \
                 EverySecondMatmul (its per-op policy) or Full"
                    .into(),
            );
        }
    };
    // The final norm's three (its output is the head's input).
    let head_norm = 8.0 * h;

    let model_state = (FP32 + 2.0 * FP32) * params / shards;
    let loss = (
        BF16 * (root + block),
        tokens * (layers * kept_block + head_norm),
        tokens * (3.0 * FP32 * v + BF16 * v),
    );
    // A block's backward: the root, this block and the one before it gathered, this block's
    // and the head's gradients unreduced.
    let in_a_block = BF16 * (root + 2.0 * block) + BF16 * (block + v * h);
    let block_transient = tokens * 3.0 * BF16 * f;
    let last_block = (
        in_a_block,
        tokens * ((layers - 1.0) * kept_block + whole_block),
        block_transient,
    );
    let block_before = (
        in_a_block + FP32 * block,
        tokens * ((layers - 2.0) * kept_block + whole_block),
        block_transient,
    );
    let optimizer = (0.0, 0.0, FP32 * params / shards);
    let (gathered, activations, transient) = [loss, last_block, block_before, optimizer]
        .into_iter()
        .max_by(|x, y| (x.0 + x.1 + x.2).total_cmp(&(y.0 + y.1 + y.2)))
        .expect("four moments");

    Ok(TorchMemory {
        model_state,
        gathered,
        activations,
        transient,
        gather_pool: BF16 * (root + block + root / shards),
        reduce_pool: FP32 * params / shards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_8b() -> Shape {
        Shape {
            hidden: 4096.0,
            ffn: 14_336.0,
            gated: true,
            heads: 32.0,
            kv_heads: 8.0,
            layers: 32,
            vocab: 128_256.0,
            tied_embeddings: false,
            experts: None,
        }
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
        // A small vocabulary: a block's backward outweighs the loss's.
        let shape = Shape {
            vocab: 1000.0,
            ..llama_8b()
        };
        let memory = fsdp_peak_memory(&FsdpRun {
            shape,
            ..run(8, Recompute::Full)
        })
        .unwrap();
        assert_eq!(memory.transient, 16_384.0 * 6.0 * 14_336.0);
    }

    #[test]
    fn what_it_does_not_model_is_refused() {
        assert!(fsdp_peak_memory(&run(8, Recompute::Selective)).is_err());
        assert!(fsdp_peak_memory(&run(0, Recompute::Full)).is_err());
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
