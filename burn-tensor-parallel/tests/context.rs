//! Context-parallel attention against dense attention on one device: the output and the
//! gradients of the queries, keys and values, at cp 1 to 4, causal and not, load-balanced and
//! not, with grouped-query attention, by the ring and by all-gather; the sends of the ring
//! counted per rank against their closed form; bad shapes refused with a sentence.
//!
//! The loss is `sum(output * r)` for a fixed random `r`. Tolerance as in `layers.rs`: the
//! blocks' partial softmaxes merge in another order than one softmax sums, so float32 rounding
//! differs: |a - b| <= 1e-5 max|b| + 1e-4 |b|.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::softmax;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_comm::parallel::{ContextLayout, RingAttention, ring_attention};
use burn_comm::{CommStats, launch};
use burn_tensor_parallel::context::repeat_kv;
use burn_tensor_parallel::{ContextParallel, CpAttention};

use common::{Inner, assert_close, random};

type B = Autodiff<Flex>;

const BATCH: usize = 2;
const HEAD_DIM: usize = 8;
/// Tokens per chunk: odd, so no block is a power of two.
const CHUNK: usize = 3;

/// Attention over the whole sequence on one device, as the Llama model computes it.
fn dense(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>, causal: bool) -> Tensor<B, 4> {
    let [_, heads, seq, dim] = q.dims();
    let group = heads / k.dims()[1];
    let scores = q.matmul(repeat_kv(k, group).swap_dims(2, 3)) / (dim as f64).sqrt();
    let scores = if causal {
        let mask: Vec<f32> = (0..seq * seq)
            .map(|i| {
                if i % seq > i / seq {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        scores + Tensor::from_data(TensorData::new(mask, [1, 1, seq, seq]), &Default::default())
    } else {
        scores
    };
    softmax(scores, 3).matmul(repeat_kv(v, group))
}

/// The tokens of a whole sequence (dim 2) that `rank` holds.
fn shard(x: &Tensor<Inner, 4>, layout: ContextLayout, rank: usize) -> Tensor<Inner, 4> {
    let positions = layout.positions(rank, x.dims()[2]).unwrap();
    let ids: Vec<i64> = positions.into_iter().map(|p| p as i64).collect();
    let len = ids.len();
    let ids = Tensor::<Inner, 1, Int>::from_data(TensorData::new(ids, [len]), &Default::default());
    x.clone().select(2, ids)
}

/// The output and the gradients of `q`, `k`, `v` of `sum(attention(q, k, v) * r)`.
type Results = [Tensor<Inner, 4>; 4];

/// What one rank saw: its results and its group's traffic after forward and after backward.
struct RankRun {
    results: Results,
    forward: CommStats,
    backward: CommStats,
}

fn run_dense(inputs: &Results, causal: bool) -> Results {
    let [q, k, v, r] = inputs
        .clone()
        .map(|x| Tensor::<B, 4>::from_inner(x).require_grad());
    let out = dense(q.clone(), k.clone(), v.clone(), causal);
    let grads = (out.clone() * r).sum().backward();
    let grad = |x: &Tensor<B, 4>| x.grad(&grads).expect("a gradient");
    [out.inner(), grad(&q), grad(&k), grad(&v)]
}

fn run_parallel(
    inputs: &Results,
    cp: usize,
    load_balanced: bool,
    causal: bool,
    method: CpAttention,
) -> Vec<RankRun> {
    let layout = ContextLayout::new(cp, load_balanced);
    launch(cp, |ctx| {
        let group = ContextParallel::new(ctx.world().clone(), load_balanced).with_attention(method);
        let [q, k, v, r] = inputs
            .clone()
            .map(|x| Tensor::<B, 4>::from_inner(shard(&x, layout, ctx.rank())).require_grad());
        let out = group.attention(q.clone(), k.clone(), v.clone(), causal)?;
        let forward = group.comm().stats();
        let grads = (out.clone() * r).sum().backward();
        let backward = group.comm().stats();
        let grad = |x: &Tensor<B, 4>| x.grad(&grads).expect("a gradient");
        Ok::<_, burn_tensor_parallel::TpError>(RankRun {
            results: [out.inner(), grad(&q), grad(&k), grad(&v)],
            forward,
            backward,
        })
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
    .collect()
}

fn inputs(seq: usize, heads: usize, kv_heads: usize, seed: u64) -> Results {
    [
        random([BATCH, heads, seq, HEAD_DIM], seed),
        random([BATCH, kv_heads, seq, HEAD_DIM], seed + 1),
        random([BATCH, kv_heads, seq, HEAD_DIM], seed + 2),
        random([BATCH, heads, seq, HEAD_DIM], seed + 3),
    ]
}

#[test]
fn context_parallel_attention_matches_one_device() {
    let names = ["output", "grad q", "grad k", "grad v"];
    for cp in 1..=4 {
        for load_balanced in [true, false] {
            for causal in [true, false] {
                for method in [CpAttention::Ring, CpAttention::AllGather] {
                    // Grouped-query (2 query heads per key) and plain multi-head.
                    for (heads, kv_heads) in [(4, 2), (2, 2)] {
                        let layout = ContextLayout::new(cp, load_balanced);
                        let seq = layout.chunk_count() * CHUNK;
                        let seed = (cp * 100 + heads * 10 + kv_heads) as u64;
                        let inputs = inputs(seq, heads, kv_heads, seed);
                        let want = run_dense(&inputs, causal);
                        let runs = run_parallel(&inputs, cp, load_balanced, causal, method);
                        for (rank, run) in runs.iter().enumerate() {
                            for (i, name) in names.iter().enumerate() {
                                let what = format!(
                                    "{name} of rank {rank}, cp {cp}, {method:?}, load-balanced {load_balanced}, causal {causal}, {heads} heads over {kv_heads}"
                                );
                                assert_close(
                                    run.results[i].clone(),
                                    shard(&want[i], layout, rank),
                                    &what,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The ring's sends per rank, forward and backward, against their closed form: without a
/// causal mask (or load-balanced) each rank passes a block at each of `cp - 1` steps forward;
/// backward passes the keys and values again and their gradients beside them, then one final
/// gradient to the block's owner. Unbalanced and causal, block `j` is needed by ranks `j..cp`
/// only, so rank `r` passes `r + 1` blocks (the last rank none) and the last rank sends every
/// other block's gradient home.
#[test]
fn the_ring_sends_only_what_is_needed() {
    for cp in 1..=4 {
        for (load_balanced, causal) in [(true, true), (false, true), (false, false), (true, false)]
        {
            let layout = ContextLayout::new(cp, load_balanced);
            let seq = layout.chunk_count() * CHUNK;
            let inputs = inputs(seq, 4, 2, 7);
            let runs = run_parallel(&inputs, cp, load_balanced, causal, CpAttention::Ring);
            let local = seq / cp;
            // Keys and values of one rank, as sent forward (f32 here).
            let block_bytes = (2 * BATCH * 2 * local * HEAD_DIM * 4) as u64;
            for (r, run) in runs.iter().enumerate() {
                let (forward, finals) = if causal && !load_balanced {
                    let passes = if r + 1 < cp { r + 1 } else { 0 };
                    (passes, if r + 1 == cp { cp - 1 } else { 0 })
                } else {
                    (cp - 1, usize::from(cp > 1))
                };
                let what =
                    format!("rank {r} of cp {cp}, load-balanced {load_balanced}, causal {causal}");
                assert_eq!(
                    run.forward.send.calls, forward as u64,
                    "forward sends of {what}"
                );
                assert_eq!(
                    run.backward.send.calls - run.forward.send.calls,
                    (2 * forward + finals) as u64,
                    "backward sends of {what}"
                );
                if causal && load_balanced {
                    // Block 0's last chunk is the end of the sequence, which only rank 0
                    // needs: after rank 0, only its first half travels.
                    let half = u64::from(r + 1 < cp) * block_bytes / 2;
                    assert_eq!(
                        run.forward.send.bytes,
                        (cp as u64 - 1) * block_bytes - half,
                        "forward bytes of {what}"
                    );
                }
                assert_eq!(run.backward.all_gather.calls, 0, "{what}");
            }
        }
    }
}

#[test]
fn all_gather_attention_gathers_keys_and_values_once_each() {
    let inputs = inputs(4 * CHUNK, 4, 2, 9);
    for run in run_parallel(&inputs, 2, true, true, CpAttention::AllGather) {
        assert_eq!(run.forward.all_gather.calls, 2);
        assert_eq!(run.backward.reduce_scatter.calls, 2);
        assert_eq!(run.backward.send.calls, 0);
    }
}

#[test]
fn shapes_that_cannot_be_split_are_refused_with_a_sentence() {
    let errors = launch(2, |ctx| {
        let group = ContextParallel::new(ctx.world().clone(), true);
        let odd = group.local_len(7).unwrap_err().to_string();
        let sharded = group
            .shard(Tensor::<Inner, 2>::zeros([1, 6], &Default::default()), 1)
            .unwrap_err()
            .to_string();
        let q = Tensor::<Inner, 4>::zeros([1, 3, 4, 8], &Default::default());
        let k = Tensor::<Inner, 4>::zeros([1, 2, 4, 8], &Default::default());
        let heads = group
            .attention(q.clone(), k.clone(), k.clone(), true)
            .unwrap_err()
            .to_string();
        let wrong_size = RingAttention {
            layout: ContextLayout::new(3, true),
            causal: true,
            scale: 1.0,
        };
        let k = Tensor::<Inner, 4>::zeros([1, 3, 4, 8], &Default::default());
        let layout = ring_attention(q.clone(), k.clone(), k, ctx.world(), wrong_size)
            .unwrap_err()
            .to_string();
        let q = Tensor::<Inner, 4>::zeros([1, 3, 3, 8], &Default::default());
        let uneven = group
            .attention(q.clone(), q.clone(), q, true)
            .unwrap_err()
            .to_string();
        Ok::<_, burn_comm::CommError>([odd, sharded, heads, layout, uneven])
    });
    for errors in errors {
        let [odd, sharded, heads, layout, uneven] = errors.unwrap();
        assert!(
            odd.contains("7 tokens") && odd.contains("multiple of 4"),
            "{odd}"
        );
        assert!(sharded.contains("6 tokens"), "{sharded}");
        assert!(heads.contains("3 query heads cannot share 2"), "{heads}");
        assert!(
            layout.contains("the layout is for 3 ranks but the group has 2"),
            "{layout}"
        );
        assert!(
            uneven.contains("3 tokens") && uneven.contains("multiple of 4"),
            "{uneven}"
        );
    }
}

/// In bf16 the ring sends keys and values in bf16 and their gradients in fp32, and gives every
/// result back in bf16: within bf16's rounding of dense fp32 attention.
#[test]
fn the_ring_in_bf16_stays_within_its_rounding() {
    let (cp, layout) = (2, ContextLayout::new(2, true));
    let inputs = inputs(layout.chunk_count() * CHUNK, 4, 2, 11);
    let want = run_dense(&inputs, true);
    let runs = launch(cp, |ctx| {
        let group = ContextParallel::new(ctx.world().clone(), true);
        let [q, k, v, r] = inputs.clone().map(|x| {
            let x = shard(&x, layout, ctx.rank()).cast(DType::BF16);
            Tensor::<B, 4>::from_inner(x).require_grad()
        });
        let out = group.attention(q.clone(), k.clone(), v.clone(), true)?;
        let grads = (out.clone() * r).sum().backward();
        let grad = |x: &Tensor<B, 4>| x.grad(&grads).expect("a gradient");
        Ok::<_, burn_tensor_parallel::TpError>([out.inner(), grad(&q), grad(&k), grad(&v)])
    });
    for (rank, run) in runs.into_iter().enumerate() {
        let run = run.unwrap_or_else(|e| panic!("{e}"));
        for (i, got) in run.into_iter().enumerate() {
            assert_eq!(got.dtype(), DType::BF16, "result {i} of rank {rank}");
            let got: Vec<f32> = got.cast(DType::F32).into_data().to_vec().unwrap();
            let want: Vec<f32> = shard(&want[i], layout, rank).into_data().to_vec().unwrap();
            let largest = want.iter().fold(0f32, |m, b| m.max(b.abs()));
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 2e-2 * largest + 2e-2 * b.abs(),
                    "result {i} of rank {rank}: {a} against dense fp32's {b}"
                );
            }
        }
    }
}
