//! Every parallel layer against its dense counterpart on one device, at tp 1, 2 and 4, with
//! and without sequence parallelism: the forward output and the gradients of the input and of
//! every weight (gathered from the shards).
//!
//! The loss is `sum(output * r)` for a fixed random `r`, so every output element gets its own
//! gradient. Tolerance: a shard computes each output as the dense layer does, but row-parallel
//! sums and the sums of gradients add partial results in another order, so float32 rounding
//! differs: |a - b| <= 1e-5 max|b| + 1e-4 |b|. The first term is relative to the largest
//! element, because where a gradient sums terms that cancel (attention's input gradient), a
//! small element carries the rounding of the large terms: joining q, k and v into one matmul
//! moves one such element by 1.5e-5 of 0.023 (float64 puts both float32 results 2e-5 and
//! 3.6e-5 from the truth).

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::{Int, Tensor, TensorData};
use burn_comm::launch;
use burn_tensor_parallel::attention::{AttentionWeights, check_heads};
use burn_tensor_parallel::{
    ColumnParallelLinear, ParallelAttention, ParallelSwiGlu, RowParallelLinear, SEQ_DIM,
    TensorParallel, TpError, VocabParallelEmbedding, vocab_parallel_cross_entropy,
};

use common::{Inner, assert_close, random};

type B = Autodiff<Flex>;

fn leaf<const D: usize>(t: &Tensor<Inner, D>) -> Tensor<B, D> {
    Tensor::from_inner(t.clone()).require_grad()
}

/// Runs `f` on `tp` ranks with sequence parallelism `sp`, once with the region ops and the
/// matmuls one after the other and once as collective matmuls of 3 chunks (which cut the
/// sequence unevenly); panics with the first failure.
fn on_ranks(tp: usize, sp: bool, f: impl Fn(&TensorParallel) -> Result<(), TpError> + Sync) {
    for overlap in [0, 3] {
        for result in launch(tp, |ctx| {
            let group = TensorParallel::new(ctx.world().clone())
                .with_sequence_parallel(sp)
                .with_comm_overlap(overlap);
            f(&group)
        }) {
            if let Err(error) = result {
                panic!("tp {tp}, sp {sp}, overlap {overlap}: {error}");
            }
        }
    }
}

/// This rank's part of `t` along `dim`.
fn part<const D: usize>(t: &Tensor<Inner, D>, dim: usize, tp: &TensorParallel) -> Tensor<Inner, D> {
    let range = tp.part(t.dims()[dim]);
    t.clone().narrow(dim, range.start, range.len())
}

/// `t`, or under SP this rank's part of its sequence.
fn seq_part<const D: usize>(t: &Tensor<Inner, D>, tp: &TensorParallel) -> Tensor<Inner, D> {
    if tp.sequence_parallel() {
        part(t, SEQ_DIM, tp)
    } else {
        t.clone()
    }
}

fn gathered<const D: usize>(
    t: Tensor<Inner, D>,
    dim: usize,
    tp: &TensorParallel,
) -> Tensor<Inner, D> {
    tp.comm().all_gather(t, dim).unwrap()
}

fn matmul3(x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3> {
    let [b, s, i] = x.dims();
    x.reshape([b * s, i])
        .matmul(w.clone())
        .reshape([b, s, w.dims()[1]])
}

const SIZES: [usize; 3] = [1, 2, 4];
const BATCH: usize = 2;
const SEQ: usize = 8;
const HIDDEN: usize = 16;

#[test]
fn column_parallel_linear_matches_dense() {
    let (x, w, bias) = (
        random([BATCH, SEQ, HIDDEN], 1),
        random([HIDDEN, 24], 2),
        random([24], 3),
    );
    let r = random([BATCH, SEQ, 24], 4);
    let (xd, wd, bd) = (leaf(&x), leaf(&w), leaf(&bias));
    let yd = matmul3(xd.clone(), wd.clone()) + bd.clone().reshape([1, 1, 24]);
    let grads = (yd.clone() * Tensor::from_inner(r.clone()))
        .sum()
        .backward();
    let (y_want, dx, dw, db) = (
        yd.inner(),
        xd.grad(&grads).unwrap(),
        wd.grad(&grads).unwrap(),
        bd.grad(&grads).unwrap(),
    );
    for tp_size in SIZES {
        for (sp, gather_output) in [(false, false), (false, true), (true, false)] {
            on_ranks(tp_size, sp, |tp| {
                let layer = ColumnParallelLinear::<B>::from_full(
                    Tensor::from_inner(w.clone()),
                    Some(Tensor::from_inner(bias.clone())),
                    tp,
                    gather_output,
                )?;
                let x_local = leaf(&seq_part(&x, tp));
                let y = layer.forward(x_local.clone())?;
                // What this rank's output covers: all features, or its own columns.
                let (y_full, r_local) = if gather_output {
                    (y.clone().inner(), r.clone())
                } else {
                    (gathered(y.clone().inner(), 2, tp), part(&r, 2, tp))
                };
                assert_close(y_full, y_want.clone(), "output");
                let grads = (y * Tensor::from_inner(r_local)).sum().backward();
                assert_close(
                    x_local.grad(&grads).unwrap(),
                    seq_part(&dx, tp),
                    "input grad",
                );
                let w_grad = layer.weight.grad(&grads).unwrap();
                assert_close(gathered(w_grad, 1, tp), dw.clone(), "weight grad");
                let b_grad = layer.bias.as_ref().unwrap().grad(&grads).unwrap();
                assert_close(gathered(b_grad, 0, tp), db.clone(), "bias grad");
                let (w_full, b_full) = layer.full()?;
                assert_close(w_full.inner(), w.clone(), "full weight");
                assert_close(b_full.unwrap().inner(), bias.clone(), "full bias");
                Ok(())
            });
        }
    }
}

#[test]
fn row_parallel_linear_matches_dense() {
    let (x, w, bias) = (
        random([BATCH, SEQ, 24], 5),
        random([24, HIDDEN], 6),
        random([HIDDEN], 7),
    );
    let r = random([BATCH, SEQ, HIDDEN], 8);
    let (xd, wd, bd) = (leaf(&x), leaf(&w), leaf(&bias));
    let yd = matmul3(xd.clone(), wd.clone()) + bd.clone().reshape([1, 1, HIDDEN]);
    let grads = (yd.clone() * Tensor::from_inner(r.clone()))
        .sum()
        .backward();
    let (y_want, dx, dw, db) = (
        yd.inner(),
        xd.grad(&grads).unwrap(),
        wd.grad(&grads).unwrap(),
        bd.grad(&grads).unwrap(),
    );
    for tp_size in SIZES {
        for (sp, input_is_parallel) in [(false, true), (false, false), (true, true)] {
            on_ranks(tp_size, sp, |tp| {
                let layer = RowParallelLinear::<B>::from_full(
                    Tensor::from_inner(w.clone()),
                    Some(Tensor::from_inner(bias.clone())),
                    tp,
                    input_is_parallel,
                )?;
                let (x_local, dx_local) = if input_is_parallel {
                    (leaf(&part(&x, 2, tp)), part(&dx, 2, tp))
                } else {
                    (leaf(&x), dx.clone())
                };
                let y = layer.forward(x_local.clone())?;
                assert_close(y.clone().inner(), seq_part(&y_want, tp), "output");
                let grads = (y * Tensor::from_inner(seq_part(&r, tp))).sum().backward();
                assert_close(x_local.grad(&grads).unwrap(), dx_local, "input grad");
                let w_grad = layer.weight.grad(&grads).unwrap();
                assert_close(gathered(w_grad, 0, tp), dw.clone(), "weight grad");
                let b_grad = layer.bias.as_ref().unwrap().grad(&grads).unwrap();
                assert_close(b_grad, db.clone(), "bias grad");
                assert_close(layer.full()?.0.inner(), w.clone(), "full weight");
                Ok(())
            });
        }
    }
}

fn tokens(vocab: usize) -> Tensor<Inner, 2, Int> {
    let ids: Vec<i64> = (0..BATCH * SEQ)
        .map(|i| ((i * 37 + 11) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [BATCH, SEQ]), &Default::default())
}

#[test]
fn vocab_parallel_embedding_matches_dense() {
    let vocab = 32;
    let (w, ids) = (random([vocab, HIDDEN], 9), tokens(vocab));
    let r = random([BATCH, SEQ, HIDDEN], 10);
    let wd = leaf(&w);
    let yd = wd
        .clone()
        .select(0, Tensor::from_inner(ids.clone().reshape([BATCH * SEQ])))
        .reshape([BATCH, SEQ, HIDDEN]);
    let grads = (yd.clone() * Tensor::from_inner(r.clone()))
        .sum()
        .backward();
    let (y_want, dw) = (yd.inner(), wd.grad(&grads).unwrap());
    for tp_size in SIZES {
        for sp in [false, true] {
            on_ranks(tp_size, sp, |tp| {
                let layer =
                    VocabParallelEmbedding::<B>::from_full(Tensor::from_inner(w.clone()), tp)?;
                let y = layer.forward(Tensor::from_inner(ids.clone()))?;
                assert_close(y.clone().inner(), seq_part(&y_want, tp), "output");
                let grads = (y * Tensor::from_inner(seq_part(&r, tp))).sum().backward();
                let w_grad = layer.weight.grad(&grads).unwrap();
                assert_close(gathered(w_grad, 0, tp), dw.clone(), "weight grad");
                assert_close(layer.full()?.inner(), w.clone(), "full table");

                let bad = Tensor::from_inner(tokens(vocab) + vocab as i64);
                let error = layer.forward(bad).unwrap_err().to_string();
                assert!(error.contains("outside the vocabulary of 32"), "{error}");
                Ok(())
            });
        }
    }
}

#[test]
fn vocab_parallel_cross_entropy_matches_dense() {
    let (n, vocab) = (BATCH * SEQ, 32);
    // Large logits: the maximum must be taken out, or exp overflows.
    let logits = random([n, vocab], 11) * 40.0;
    let targets = tokens(vocab).reshape([n]);
    let ld = leaf(&logits);
    let picked =
        log_softmax(ld.clone(), 1).gather(1, Tensor::from_inner(targets.clone().reshape([n, 1])));
    let loss_d = picked.reshape([n]).neg();
    let grads = loss_d.clone().mean().backward();
    let (loss_want, dl) = (loss_d.inner(), ld.grad(&grads).unwrap());
    for tp_size in SIZES {
        on_ranks(tp_size, false, |tp| {
            let local = leaf(&part(&logits, 1, tp));
            let loss = vocab_parallel_cross_entropy(
                local.clone(),
                Tensor::from_inner(targets.clone()),
                tp,
            )?;
            assert_close(loss.clone().inner(), loss_want.clone(), "loss");
            let grads = loss.mean().backward();
            assert_close(local.grad(&grads).unwrap(), part(&dl, 1, tp), "logits grad");
            Ok(())
        });
    }
}

/// Plain softmax attention over `q` and the key/value heads it shares (no mask, no positions).
fn attend<Bk: burn::tensor::backend::Backend>(
    q: Tensor<Bk, 4>,
    k: Tensor<Bk, 4>,
    v: Tensor<Bk, 4>,
) -> Tensor<Bk, 4> {
    let group = q.dims()[1] / k.dims()[1];
    let repeat = |t: Tensor<Bk, 4>| {
        let [b, h, s, d] = t.dims();
        t.unsqueeze_dim::<5>(2)
            .repeat_dim(2, group)
            .reshape([b, h * group, s, d])
    };
    let scale = (q.dims()[3] as f64).sqrt();
    softmax(q.matmul(repeat(k).swap_dims(2, 3)) / scale, 3).matmul(repeat(v))
}

#[test]
fn head_sharded_attention_matches_dense() {
    let heads = 4;
    let head_dim = HIDDEN / heads;
    // Key/value heads split (4), split or shared (2), always shared (1).
    for kv_heads in [4, 2, 1] {
        let kv = kv_heads * head_dim;
        let x = random([BATCH, SEQ, HIDDEN], 12);
        let full = [
            random([HIDDEN, HIDDEN], 13),
            random([HIDDEN, kv], 14),
            random([HIDDEN, kv], 15),
            random([HIDDEN, HIDDEN], 16),
        ];
        let r = random([BATCH, SEQ, HIDDEN], 17);
        let xd = leaf(&x);
        let wd: Vec<Tensor<B, 2>> = full.iter().map(leaf).collect();
        let split =
            |y: Tensor<B, 3>, h: usize| y.reshape([BATCH, SEQ, h, head_dim]).swap_dims(1, 2);
        let context = attend(
            split(matmul3(xd.clone(), wd[0].clone()), heads),
            split(matmul3(xd.clone(), wd[1].clone()), kv_heads),
            split(matmul3(xd.clone(), wd[2].clone()), kv_heads),
        );
        let yd = matmul3(
            context.swap_dims(1, 2).reshape([BATCH, SEQ, HIDDEN]),
            wd[3].clone(),
        );
        let grads = (yd.clone() * Tensor::from_inner(r.clone()))
            .sum()
            .backward();
        let y_want = yd.inner();
        let dx = xd.grad(&grads).unwrap();
        let dw: Vec<Tensor<Inner, 2>> = wd.iter().map(|w| w.grad(&grads).unwrap()).collect();
        for tp_size in SIZES {
            for sp in [false, true] {
                on_ranks(tp_size, sp, |tp| {
                    let weights = AttentionWeights {
                        q: Tensor::from_inner(full[0].clone()),
                        k: Tensor::from_inner(full[1].clone()),
                        v: Tensor::from_inner(full[2].clone()),
                        o: Tensor::from_inner(full[3].clone()),
                    };
                    let layer = ParallelAttention::<B>::from_full(weights, heads, kv_heads, tp)?;
                    let x_local = leaf(&seq_part(&x, tp));
                    let y = layer.forward(x_local.clone(), attend)?;
                    let what = format!("kv heads {kv_heads}");
                    assert_close(
                        y.clone().inner(),
                        seq_part(&y_want, tp),
                        &format!("{what}: output"),
                    );
                    let grads = (y * Tensor::from_inner(seq_part(&r, tp))).sum().backward();
                    assert_close(
                        x_local.grad(&grads).unwrap(),
                        seq_part(&dx, tp),
                        &format!("{what}: input grad"),
                    );
                    // Each gradient gathered the way its weight is (one copy of shared heads).
                    let full_grads = [
                        full_grad(&layer.q_proj, &grads),
                        full_grad(&layer.k_proj, &grads),
                        full_grad(&layer.v_proj, &grads),
                        gathered(layer.o_proj.weight.grad(&grads).unwrap(), 0, tp),
                    ];
                    for (i, (got, want)) in full_grads.into_iter().zip(&dw).enumerate() {
                        assert_close(
                            got,
                            want.clone(),
                            &format!("{what}: grad of {}", ["q", "k", "v", "o"][i]),
                        );
                    }
                    let weights = layer.full()?;
                    for (got, want) in [weights.q, weights.k, weights.v, weights.o]
                        .into_iter()
                        .zip(&full)
                    {
                        assert_close(got.inner(), want.clone(), &format!("{what}: full weight"));
                    }
                    Ok(())
                });
            }
        }
    }
}

/// The full gradient of a column-parallel weight, gathered as the weight itself is.
fn full_grad(
    layer: &ColumnParallelLinear<B>,
    grads: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
) -> Tensor<Inner, 2> {
    let mut holder = layer.clone();
    holder.weight = Param::from_tensor(Tensor::from_inner(layer.weight.grad(grads).unwrap()));
    holder.full().unwrap().0.inner()
}

#[test]
fn parallel_swiglu_matches_dense() {
    let inter = 32;
    let x = random([BATCH, SEQ, HIDDEN], 18);
    let full = [
        random([HIDDEN, inter], 19),
        random([HIDDEN, inter], 20),
        random([inter, HIDDEN], 21),
    ];
    let r = random([BATCH, SEQ, HIDDEN], 22);
    let xd = leaf(&x);
    let wd: Vec<Tensor<B, 2>> = full.iter().map(leaf).collect();
    let hidden = silu(matmul3(xd.clone(), wd[0].clone())) * matmul3(xd.clone(), wd[1].clone());
    let yd = matmul3(hidden, wd[2].clone());
    let grads = (yd.clone() * Tensor::from_inner(r.clone()))
        .sum()
        .backward();
    let (y_want, dx) = (yd.inner(), xd.grad(&grads).unwrap());
    let dw: Vec<Tensor<Inner, 2>> = wd.iter().map(|w| w.grad(&grads).unwrap()).collect();
    for tp_size in SIZES {
        for sp in [false, true] {
            on_ranks(tp_size, sp, |tp| {
                let [gate, up, down] = full.clone().map(Tensor::from_inner);
                let layer = ParallelSwiGlu::<B>::from_full(gate, up, down, tp)?;
                let x_local = leaf(&seq_part(&x, tp));
                let y = layer.forward(x_local.clone())?;
                assert_close(y.clone().inner(), seq_part(&y_want, tp), "output");
                let grads = (y * Tensor::from_inner(seq_part(&r, tp))).sum().backward();
                assert_close(
                    x_local.grad(&grads).unwrap(),
                    seq_part(&dx, tp),
                    "input grad",
                );
                let got = [
                    full_grad(&layer.gate_proj, &grads),
                    full_grad(&layer.up_proj, &grads),
                    gathered(layer.down_proj.weight.grad(&grads).unwrap(), 0, tp),
                ];
                for (got, want) in got.into_iter().zip(&dw) {
                    assert_close(got, want.clone(), "weight grad");
                }
                for (got, want) in layer.full()?.into_iter().zip(&full) {
                    assert_close(got.inner(), want.clone(), "full weight");
                }
                Ok(())
            });
        }
    }
}

#[test]
fn shapes_that_do_not_split_are_refused_with_what_to_change() {
    let error = check_heads(6, 3, 4).unwrap_err().to_string();
    assert!(
        error.contains("6 attention heads do not divide by the tensor-parallel size 4"),
        "{error}"
    );
    let error = check_heads(8, 2, 4)
        .map(|_| "ok".to_string())
        .unwrap_or_else(|e| e.to_string());
    assert_eq!(
        error, "ok",
        "2 key/value heads are shared by pairs of 4 ranks"
    );
    let error = check_heads(12, 3, 6)
        .map(|_| "ok".to_string())
        .unwrap_or_else(|e| e.to_string());
    assert_eq!(error, "ok");
    let error = check_heads(8, 4, 8)
        .map(|_| "ok".to_string())
        .unwrap_or_else(|e| e.to_string());
    assert_eq!(error, "ok");
    let error = check_heads(12, 6, 4).unwrap_err().to_string();
    assert!(
        error.contains("6 key/value heads can neither be split over nor shared by 4"),
        "{error}"
    );

    on_ranks(4, true, |tp| {
        let error =
            VocabParallelEmbedding::<B>::from_full(Tensor::from_inner(random([30, 8], 1)), tp)
                .unwrap_err()
                .to_string();
        assert!(
            error.contains("the vocabulary (30) does not divide by the tensor-parallel size 4"),
            "{error}"
        );
        let error = ColumnParallelLinear::<B>::from_full(
            Tensor::from_inner(random([8, 6], 1)),
            None,
            tp,
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("output features of a column-parallel linear (6)"),
            "{error}"
        );
        let [g, u, d] =
            [random([8, 6], 1), random([8, 6], 2), random([6, 8], 3)].map(Tensor::from_inner);
        let error = ParallelSwiGlu::<B>::from_full(g, u, d, tp)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("intermediate size of the MLP (6)"),
            "{error}"
        );
        // Under SP what leaves a region is split by sequence: no gathered output, no full input.
        let w = || Tensor::<B, 2>::from_inner(random([8, 8], 1));
        let error = ColumnParallelLinear::from_full(w(), None, tp, true)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("cannot gather its output under sequence parallelism"),
            "{error}"
        );
        let error = RowParallelLinear::from_full(w(), None, tp, false)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("takes the output of a column-parallel one"),
            "{error}"
        );
        let weights = AttentionWeights {
            q: w(),
            k: w(),
            v: w(),
            o: w(),
        };
        let error = ParallelAttention::from_full(weights, 4, 2, tp)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("do not fit 4 query and 2 key/value heads"),
            "{error}"
        );
        let no_tokens = Tensor::<B, 2>::zeros([0, 8], &Default::default());
        let no_targets = Tensor::<B, 1, Int>::zeros([0], &Default::default());
        let error = vocab_parallel_cross_entropy(no_tokens, no_targets, tp)
            .unwrap_err()
            .to_string();
        assert!(error.contains("no tokens"), "{error}");
        // A sequence of 6 cannot be split over 4 ranks: refused before any communication.
        let table =
            VocabParallelEmbedding::<B>::from_full(Tensor::from_inner(random([32, 8], 1)), tp)?;
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(vec![1i64; 6], [1, 6]),
            &Default::default(),
        );
        let error = table.forward(ids).unwrap_err().to_string();
        assert!(
            error.contains("the sequence length (6) does not divide by the tensor-parallel size 4"),
            "{error}"
        );
        Ok(())
    });
}
