//! `llama plan`'s activation estimate against the bytes a forward of `tiny` and `tiny-moe` really
//! keeps for its backward, in fp32 and bf16, and per rank under tensor and context parallelism.
//! One test: the count is of the whole process.

use benches::activations::{
    measured_activation_bytes, measured_context_parallel_activation_bytes,
    measured_tensor_parallel_activation_bytes,
};
use benches::memory::CountingAllocator;
use burn::tensor::DType;
use burn_tensor_parallel::CpAttention;
use llama::LlamaConfig;
use llama::plan::{ContextSplit, TensorSplit, activation_bytes};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn the_plans_activations_are_within_5_percent_of_what_a_forward_keeps() {
    let config = LlamaConfig::preset("tiny").unwrap();
    // A mixture of experts too, its z-loss on and off.
    let moe = LlamaConfig::preset("tiny-moe").unwrap();
    let cases = [
        (&config, 4, 64),
        (&config, 2, 256),
        (&moe, 2, 256),
        (&moe.clone().with_router_z_loss_coef(1e-3), 4, 64),
    ];
    for (config, micro_batch, seq_len) in cases {
        for dtype in [DType::F32, DType::BF16] {
            let measured = measured_activation_bytes(config, micro_batch, seq_len, dtype) as f64;
            let layers = config.num_hidden_layers;
            let estimated = activation_bytes(
                config,
                micro_batch,
                seq_len,
                layers,
                TensorSplit::WHOLE,
                ContextSplit::WHOLE,
                dtype.size(),
            ) as f64;
            let off = (measured - estimated).abs() / estimated;
            eprintln!(
                "{} {dtype:?} {micro_batch} x {seq_len}: measured {measured}, estimated {estimated} ({:+.1}%)",
                if config.is_moe() { "tiny-moe" } else { "tiny" },
                100.0 * (measured - estimated) / estimated
            );
            assert!(
                off < 0.05,
                "{dtype:?} {micro_batch} x {seq_len}: measured {measured} bytes, estimated {estimated}"
            );
        }
    }
    // Under tensor parallelism, each rank counted in its own slot. With sequence parallelism
    // each linear keeps its input gathered whole, and the local transport gives every thread
    // rank a view of one gathered buffer, charged to the thread that made it: so the ranks'
    // sum is checked, against tp ranks' estimates less the (tp - 1) buffers they share. What
    // sp saves (the difference, where attention and the MLP cancel) is held closer: each of
    // sp's terms is about 4 % of the whole.
    let (micro_batch, seq_len, layers) = (2, 256, config.num_hidden_layers);
    // In bf16 too: a model cast to bf16 and then cut over tp kept bf16 (it became f32).
    for (tp, dtype) in [(2, DType::F32), (4, DType::F32), (2, DType::BF16)] {
        let gathered =
            (micro_batch * seq_len * (2 * layers + 1) * config.hidden_size * dtype.size()) as f64;
        let [whole, split] = [false, true].map(|sequence_parallel| {
            let estimated = activation_bytes(
                &config,
                micro_batch,
                seq_len,
                layers,
                TensorSplit {
                    ranks: tp,
                    sequence_parallel,
                },
                ContextSplit::WHOLE,
                dtype.size(),
            ) as f64;
            let shared = match sequence_parallel {
                true => (tp - 1) as f64 * gathered,
                false => 0.0,
            };
            let expected = tp as f64 * estimated - shared;
            let measured = measured_tensor_parallel_activation_bytes(
                &config,
                micro_batch,
                seq_len,
                dtype,
                tp,
                sequence_parallel,
            )
            .iter()
            .sum::<usize>() as f64;
            let off = (measured - expected) / expected;
            eprintln!(
                "tp {tp} sp {sequence_parallel} {dtype:?}: measured {measured} bytes over the ranks, expected {expected} ({:+.1}%), {estimated} per rank",
                100.0 * off
            );
            assert!(
                off.abs() < 0.05,
                "tp {tp} sp {sequence_parallel} {dtype:?}: measured {measured} bytes over the ranks, expected {expected}"
            );
            (measured, expected)
        });
        // What sp saves is a tenth of the whole, so each measurement's noise (up to 0.3 % of
        // the whole, the allocations the thread ranks happen to hold at the peak) is up to
        // 3-4 % of it; one of sp's terms counted wrong would be about 40 %.
        let (saved, expected) = (whole.0 - split.0, whole.1 - split.1);
        assert!(
            ((saved - expected) / expected).abs() < 0.1,
            "tp {tp} {dtype:?}: sp saved {saved} bytes over the ranks, the estimate {expected}"
        );
    }
    // Under context parallelism, per rank (each counted in its own slot).
    let (micro_batch, seq_len, layers) = (2, 256, config.num_hidden_layers);
    let splits = [
        (2, CpAttention::Ring),
        (4, CpAttention::Ring),
        (2, CpAttention::AllGather),
    ];
    for (ranks, attention) in splits {
        let measured = measured_context_parallel_activation_bytes(
            &config,
            micro_batch,
            seq_len,
            DType::F32,
            ranks,
            attention,
        ) as f64;
        let split = ContextSplit { ranks, attention };
        let estimated = activation_bytes(
            &config,
            micro_batch,
            seq_len,
            layers,
            TensorSplit::WHOLE,
            split,
            4,
        ) as f64;
        let off = (measured - estimated).abs() / estimated;
        assert!(
            off < 0.05,
            "cp {ranks} {attention:?}: measured {measured} bytes per rank, estimated {estimated}"
        );
    }
}
