//! The dispatcher alone, as Megatron tests it, and the MoE layer split over expert-parallel
//! ranks against the same layer on one device: with weights 1/k and identity experts, dispatch
//! then combine returns the input and its gradient; with a capacity no expert takes more copies
//! of a rank's tokens than it, and the output is the input times the kept weights; padded and
//! unpadded dispatch agree forward and backward; the layer at ep 2 and 4 gives one device's
//! output, losses and gradients; bad input is refused with a sentence.
//!
//! Tolerance where sums are reordered (the layer against one device): |a - b| <= 1e-5 max|b| +
//! 1e-4 |b|, as the tensor-parallel tests use.

use std::sync::Mutex;

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Int, Tensor, TensorData};
use burn_comm::{CommError, launch};
use burn_expert_parallel::{
    Dispatch, ExpertParallel, Moe, MoeError, RouterConfig, Routing, dispatch_combine,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

type B = Autodiff<Flex>;
type Inner = Flex;

const EXPERTS: usize = 8;
const HIDDEN: usize = 6;

fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Inner, D> {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let values: Vec<f32> = (0..shape.iter().product())
        .map(|_| normal.sample(&mut rng))
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn values<const D: usize>(x: &Tensor<Inner, D>) -> Vec<f32> {
    x.clone().into_data().to_vec().unwrap()
}

#[track_caller]
fn assert_close<const D: usize>(got: &Tensor<Inner, D>, want: &Tensor<Inner, D>, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (got, want) = (values(got), values(want));
    let largest = want.iter().fold(0f32, |m, b| m.max(b.abs()));
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * largest + 1e-4 * b.abs(),
            "{what}: element {i} is {a}, expected {b}"
        );
    }
}

/// `tokens` tokens each routed to `k` distinct experts, drawn from `seed` (skewed towards
/// expert 0 when `skewed`), with weights `weight(token, slot)`.
fn routing(
    tokens: usize,
    k: usize,
    seed: u64,
    skewed: bool,
    weight: impl Fn(usize, usize) -> f32,
) -> Routing<B> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ids = Vec::new();
    let mut weights = Vec::new();
    for t in 0..tokens {
        let mut experts: Vec<i64> = (0..EXPERTS as i64).collect();
        experts.shuffle(&mut rng);
        if skewed && rng.random_bool(0.8) {
            let at = experts.iter().position(|&e| e == 0).unwrap();
            experts.swap(0, at);
        }
        ids.extend_from_slice(&experts[..k]);
        weights.extend((0..k).map(|slot| weight(t, slot)));
    }
    let device = Default::default();
    Routing {
        experts: Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [tokens, k]), &device),
        weights: Tensor::from_data(TensorData::new(weights, [tokens, k]), &device),
    }
}

fn group(ctx: &burn_comm::RankContext, ep: usize) -> ExpertParallel {
    let comm = (ep > 1).then(|| ctx.world().clone());
    ExpertParallel::new(EXPERTS, comm).unwrap()
}

#[test]
fn dispatch_then_combine_with_identity_experts_returns_the_input_and_its_gradient() {
    for ep in [1, 2, 4] {
        for k in [1, 2] {
            for dispatch in [Dispatch::Unpadded, Dispatch::Padded] {
                let results = launch(ep, |ctx| {
                    let tokens = 12;
                    let seed = 10 * ctx.rank() as u64 + k as u64;
                    let x = random([tokens, HIDDEN], seed);
                    let r = random([tokens, HIDDEN], seed + 100);
                    let routing = routing(tokens, k, seed, false, |_, _| 1.0 / k as f32);
                    let leaf = Tensor::<B, 2>::from_inner(x.clone()).require_grad();
                    let mut seen = 0;
                    // Padded, every copy fits: the capacity is the tokens.
                    let (out, stats) = dispatch_combine(
                        leaf.clone(),
                        &routing,
                        &group(&ctx, ep),
                        Some(tokens),
                        dispatch,
                        |_, rows| {
                            seen += rows.dims()[0];
                            Ok(rows)
                        },
                    )?;
                    let grads = (out.clone() * Tensor::from_inner(r.clone()))
                        .sum()
                        .backward();
                    assert_eq!(stats.dropped, 0);
                    assert_eq!(stats.tokens_per_expert.iter().sum::<usize>(), tokens * k);
                    Ok::<_, MoeError>((x, r, out.inner(), leaf.grad(&grads).unwrap(), seen))
                });
                let mut received = 0;
                for (rank, result) in results.into_iter().enumerate() {
                    let (x, r, out, grad, seen) = result.unwrap_or_else(|e| panic!("{e}"));
                    let what = format!("ep {ep}, top-{k}, {dispatch:?}, rank {rank}");
                    assert_close(&out, &x, &format!("{what}: output"));
                    assert_close(&grad, &r, &format!("{what}: gradient"));
                    received += seen;
                }
                // Unpadded, the experts see every copy once; padded, every slot of every rank.
                let expected = match dispatch {
                    Dispatch::Unpadded => ep * 12 * k,
                    Dispatch::Padded => ep * EXPERTS * 12,
                };
                assert_eq!(received, expected, "ep {ep}, top-{k}, {dispatch:?}: rows");
            }
        }
    }
}

#[test]
fn a_capacity_drops_copies_past_it_and_keeps_the_weights_of_the_rest() {
    let (tokens, k, capacity) = (16, 2, 3);
    for ep in [1, 2] {
        let most = Mutex::new(vec![0; EXPERTS]);
        let results = launch(ep, |ctx| {
            let seed = 50 + ctx.rank() as u64;
            let x = random([tokens, HIDDEN], seed);
            let weight = |t: usize, slot: usize| 0.25 + 0.1 * ((t + slot) % 5) as f32;
            let routing = routing(tokens, k, seed, true, weight);
            let ep_group = group(&ctx, ep);
            let local = ep_group.local_experts();
            let (out, stats) = dispatch_combine(
                Tensor::<B, 2>::from_inner(x.clone()),
                &routing,
                &ep_group,
                Some(capacity),
                Dispatch::Unpadded,
                |j, rows| {
                    let mut most = most.lock().unwrap();
                    most[local.start + j] = most[local.start + j].max(rows.dims()[0]);
                    Ok(rows)
                },
            )?;
            // The kept copies by hand: in token order, the first `capacity` per expert.
            let ids: Vec<i64> = routing.experts.to_data().convert::<i64>().to_vec().unwrap();
            let mut taken = vec![0; EXPERTS];
            let mut scale = vec![0f32; tokens];
            for (flat, &e) in ids.iter().enumerate() {
                if taken[e as usize] < capacity {
                    taken[e as usize] += 1;
                    scale[flat / k] += weight(flat / k, flat % k);
                }
            }
            let scale = Tensor::<Inner, 2>::from_data(
                TensorData::new(scale, [tokens, 1]),
                &Default::default(),
            );
            Ok::<_, MoeError>((out.inner(), x * scale, stats, taken))
        });
        for (rank, result) in results.into_iter().enumerate() {
            let (out, expected, stats, taken) = result.unwrap_or_else(|e| panic!("{e}"));
            let what = format!("ep {ep}, rank {rank}");
            assert_close(&out, &expected, &format!("{what}: output"));
            assert_eq!(stats.tokens_per_expert, taken, "{what}");
            assert!(stats.dropped > 0, "{what}: the skewed routing drops copies");
            assert!(
                stats.tokens_per_expert.iter().all(|&n| n <= capacity),
                "{what}"
            );
        }
        let most = most.into_inner().unwrap();
        assert!(
            most.iter().all(|&n| n <= ep * capacity),
            "ep {ep}: an expert took {most:?} rows, more than {capacity} from each rank"
        );
    }
}

#[test]
fn padded_and_unpadded_dispatch_agree_forward_and_backward() {
    for (ep, capacity) in [(2, 2), (2, 24), (4, 3)] {
        let run = |dispatch| {
            launch(ep, |ctx| {
                let tokens = 12;
                let seed = 70 + ctx.rank() as u64;
                let x = random([tokens, HIDDEN], seed);
                let r = random([tokens, HIDDEN], seed + 100);
                let routing = routing(tokens, 2, seed, true, |t, s| 0.3 + 0.05 * (t + s) as f32);
                let ep_group = group(&ctx, ep);
                let first = ep_group.local_experts().start;
                let leaf = Tensor::<B, 2>::from_inner(x).require_grad();
                let (out, _) = dispatch_combine(
                    leaf.clone(),
                    &routing,
                    &ep_group,
                    Some(capacity),
                    dispatch,
                    // Every expert its own nonlinear map, so misrouted rows show.
                    |j, rows| Ok(rows.clone() * rows.tanh() * (1.0 + (first + j) as f64)),
                )?;
                let grads = (out.clone() * Tensor::from_inner(r)).sum().backward();
                Ok::<_, MoeError>((out.inner(), leaf.grad(&grads).unwrap()))
            })
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
            .collect::<Vec<_>>()
        };
        let (unpadded, padded) = (run(Dispatch::Unpadded), run(Dispatch::Padded));
        for (rank, (u, p)) in unpadded.iter().zip(&padded).enumerate() {
            let what = format!("ep {ep}, capacity {capacity}, rank {rank}");
            assert_close(&p.0, &u.0, &format!("{what}: output"));
            assert_close(&p.1, &u.1, &format!("{what}: gradient"));
        }
    }
}

/// What one rank of the layer gave: output, aux and z losses, and the gradients of the input,
/// the router and its experts (gate, up, down).
type LayerRun = (
    Tensor<Inner, 2>,
    f32,
    f32,
    Tensor<Inner, 2>,
    Tensor<Inner, 2>,
    [Tensor<Inner, 3>; 3],
);

/// The layer at `ep` expert-parallel ranks, each expert split over `etp` ranks (each group
/// of `etp` neighbours holding the same tokens), against one device: every rank's output and
/// input gradient, the mean of the balancing and z losses, the router's gradient summed over
/// the ranks of distinct tokens, and each rank's slice of its experts' gradients.
#[test]
fn a_moe_layer_split_over_expert_parallel_ranks_matches_one_device() {
    let (tokens, intermediate) = (10, 12);
    let mut config = RouterConfig::new(EXPERTS, 2);
    config.z_loss_coeff = 0.001;
    let full = (
        random([HIDDEN, EXPERTS], 1),
        [
            random([EXPERTS, HIDDEN, intermediate], 2),
            random([EXPERTS, HIDDEN, intermediate], 3),
            random([EXPERTS, intermediate, HIDDEN], 4),
        ],
    );
    // Each expert-parallel rank's tokens (expert parallelism is data-parallel for them), and
    // their whole.
    let x = |rank: usize| random([tokens, HIDDEN], 20 + rank as u64);
    let r = |rank: usize| random([tokens, HIDDEN], 40 + rank as u64);
    // One rank of the layer at `ep` x `etp` ranks, on its tokens `x` whose outputs the loss
    // weighs by `r`.
    let layer = |ctx: &burn_comm::RankContext,
                 (ep, etp): (usize, usize),
                 x: Tensor<Inner, 2>,
                 r: Tensor<Inner, 2>| {
        let world = ctx.world();
        let (e, t) = (ctx.rank() / etp, ctx.rank() % etp);
        let ep_comm = (ep > 1).then(|| world.split("ep", t)).transpose()?;
        let etp_comm = (etp > 1).then(|| world.split("etp", e)).transpose()?;
        let split = ExpertParallel::new(EXPERTS, ep_comm.clone())?.with_tensor_parallel(etp_comm);
        let (router, experts) = full.clone();
        let experts = experts.map(Tensor::<B, 3>::from_inner);
        let moe = Moe::from_full(Tensor::from_inner(router), experts, config, split)?;
        let leaf = Tensor::<B, 2>::from_inner(x).require_grad();
        let out = moe.forward(leaf.clone(), ep_comm.as_ref())?;
        // The whole batch's loss is the sum of the ranks' outputs' and the mean of their
        // balancing losses.
        let share = 1.0 / ep as f64;
        let loss = (out.output.clone() * Tensor::from_inner(r)).sum()
            + (out.aux_loss.clone() + out.z_loss.clone()) * share;
        let grads = loss.backward();
        let grad = |p: &burn::module::Param<Tensor<B, 3>>| p.val().grad(&grads).unwrap();
        Ok::<LayerRun, MoeError>((
            out.output.inner(),
            out.aux_loss.into_scalar(),
            out.z_loss.into_scalar(),
            leaf.grad(&grads).unwrap(),
            moe.router.val().grad(&grads).unwrap(),
            [grad(&moe.gate), grad(&moe.up), grad(&moe.down)],
        ))
    };
    for (ep, etp) in [(2, 1), (4, 1), (1, 2), (2, 2)] {
        let whole_x = Tensor::cat((0..ep).map(x).collect(), 0);
        let whole_r = Tensor::cat((0..ep).map(r).collect(), 0);
        let one = launch(1, |ctx| {
            layer(&ctx, (1, 1), whole_x.clone(), whole_r.clone())
        })
        .remove(0)
        .unwrap_or_else(|e| panic!("{e}"));
        let split: Vec<LayerRun> = launch(ep * etp, |ctx| {
            let e = ctx.rank() / etp;
            layer(&ctx, (ep, etp), x(e), r(e))
        })
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
        // The first of each group of ranks holding the same tokens.
        let distinct: Vec<&LayerRun> = split.iter().step_by(etp).collect();
        let rows = |t: &Tensor<Inner, 2>, e: usize| t.clone().narrow(0, e * tokens, tokens);
        let mean = |f: fn(&LayerRun) -> f32| distinct.iter().map(|s| f(s)).sum::<f32>() / ep as f32;
        let what = format!("ep {ep} x etp {etp}");
        assert!(
            (mean(|s| s.1) - one.1).abs() <= 1e-5 * one.1.abs(),
            "{what}: aux loss"
        );
        assert!(
            (mean(|s| s.2) - one.2).abs() <= 1e-5 * one.2.abs(),
            "{what}: z-loss"
        );
        let router: Tensor<Inner, 2> = distinct
            .iter()
            .map(|s| s.4.clone())
            .reduce(|a, b| a + b)
            .unwrap();
        assert_close(&router, &one.4, &format!("{what}: router gradient"));
        let (local, slice) = (EXPERTS / ep, intermediate / etp);
        for (rank, s) in split.iter().enumerate() {
            let (e, t) = (rank / etp, rank % etp);
            let what = format!("{what}, rank {rank}");
            assert_close(&s.0, &rows(&one.0, e), &format!("{what}: output"));
            assert_close(&s.3, &rows(&one.3, e), &format!("{what}: input gradient"));
            for (i, (name, dim)) in [("gate", 2), ("up", 2), ("down", 1)]
                .into_iter()
                .enumerate()
            {
                let want =
                    one.5[i]
                        .clone()
                        .narrow(0, e * local, local)
                        .narrow(dim, t * slice, slice);
                assert_close(&s.5[i], &want, &format!("{what}: {name} gradient"));
            }
        }
    }
}

/// Experts that receive no rows still run (on none), tied into the balancing loss, so their
/// weights get a gradient, zero: a data-parallel reduction never misses it.
#[test]
fn experts_without_rows_get_zero_gradients() {
    let moe = Moe::from_full(
        Tensor::<B, 2>::from_inner(random([HIDDEN, EXPERTS], 1)),
        [
            random([EXPERTS, HIDDEN, 4], 2),
            random([EXPERTS, HIDDEN, 4], 3),
            random([EXPERTS, 4, HIDDEN], 4),
        ]
        .map(Tensor::from_inner),
        RouterConfig::new(EXPERTS, 2),
        ExpertParallel::unsplit(EXPERTS),
    )
    .unwrap();
    let out = moe
        .forward(
            Tensor::<B, 2>::zeros([0, HIDDEN], &Default::default()),
            None,
        )
        .unwrap();
    assert_eq!(out.output.dims(), [0, HIDDEN]);
    let aux: f32 = out.aux_loss.clone().into_scalar();
    assert_eq!(aux, 0.0, "a batch without tokens has no balancing loss");
    let grads = (out.output.sum() + out.aux_loss + out.z_loss).backward();
    for (name, weight) in [("gate", &moe.gate), ("up", &moe.up), ("down", &moe.down)] {
        let grad = weight
            .val()
            .grad(&grads)
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        assert_eq!(grad.dims(), weight.dims());
        assert_eq!(grad.abs().max().into_scalar(), 0.0, "{name}");
    }
}

#[test]
fn bad_input_is_refused_with_a_sentence() {
    let errors = launch(4, |ctx| {
        let split = ExpertParallel::new(6, Some(ctx.world().clone()))
            .unwrap_err()
            .to_string();
        let top_k = RouterConfig::new(2, 3).validate().unwrap_err().to_string();
        let mut factor = RouterConfig::new(8, 2);
        factor.capacity_factor = Some(0.0);
        let factor = factor.validate().unwrap_err().to_string();
        let ep = group(&ctx, 4);
        let x = Tensor::<B, 2>::zeros([2, HIDDEN], &Default::default());
        let mut bad = routing(2, 1, 1, false, |_, _| 1.0);
        bad.experts =
            Tensor::from_data(TensorData::new(vec![1i64, 9], [2, 1]), &Default::default());
        // Every rank fails before any exchange, so none waits.
        let unknown =
            dispatch_combine(x.clone(), &bad, &ep, None, Dispatch::Unpadded, |_, r| Ok(r))
                .unwrap_err()
                .to_string();
        let padded = dispatch_combine(x, &bad, &ep, None, Dispatch::Padded, |_, r| Ok(r))
            .unwrap_err()
            .to_string();
        Ok::<_, CommError>([split, top_k, factor, unknown, padded])
    });
    for errors in errors {
        let [split, top_k, factor, unknown, padded] = errors.unwrap();
        assert!(
            split.contains("6 experts cannot be split evenly over 4"),
            "{split}"
        );
        assert!(top_k.contains("top-3 of 2 experts"), "{top_k}");
        assert!(factor.contains("capacity factor 0"), "{factor}");
        assert!(
            unknown.contains("token 1 is routed to expert 9, but the layer has 8"),
            "{unknown}"
        );
        assert!(padded.contains("give a capacity"), "{padded}");
    }
}

/// A rank with no tokens, and ranks whose copies all stay home, still take part in every
/// exchange forward and backward (empty parts): nobody waits, and the gradients are right.
#[test]
fn a_rank_with_no_tokens_or_no_copies_for_a_peer_neither_hangs_nor_loses_gradients() {
    let results = burn_comm::launch_with(
        burn_comm::LaunchConfig::new(2).with_timeout(std::time::Duration::from_secs(20)),
        |ctx| {
            // Rank 0: no tokens at all. Rank 1: copies for both ranks' experts (0 and 7), and
            // a token whose copies all go to its own (4 and 5).
            let (tokens, ids) = match ctx.rank() {
                0 => (0, vec![]),
                _ => (3, vec![0i64, 7, 4, 5, 7, 0]),
            };
            let device = Default::default();
            let routing = Routing::<B> {
                experts: Tensor::from_data(TensorData::new(ids, [tokens, 2]), &device),
                weights: Tensor::from_data(
                    TensorData::new(vec![0.5f32; 2 * tokens], [tokens, 2]),
                    &device,
                ),
            };
            let x = random([tokens, HIDDEN], 90 + ctx.rank() as u64);
            let r = random([tokens, HIDDEN], 95 + ctx.rank() as u64);
            let leaf = Tensor::<B, 2>::from_inner(x.clone()).require_grad();
            let (out, _) = dispatch_combine(
                leaf.clone(),
                &routing,
                &group(&ctx, 2),
                None,
                Dispatch::Unpadded,
                |_, rows| Ok(rows.clone() * 3.0),
            )?;
            let grads = (out.clone() * Tensor::from_inner(r.clone()))
                .sum()
                .backward();
            Ok::<_, MoeError>((x, r, out.inner(), leaf.grad(&grads)))
        },
    );
    for (rank, result) in results.into_iter().enumerate() {
        let (x, r, out, grad) = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        // Two copies of weight 1/2 through experts that triple: 3x, and 3r backward.
        if rank == 1 {
            assert_close(&out, &(x * 3.0), "rank 1: output");
            assert_close(&grad.expect("a gradient"), &(r * 3.0), "rank 1: gradient");
        } else {
            assert_eq!(out.dims(), [0, HIDDEN], "rank 0: no tokens, no output");
        }
    }
}

/// Every copy of both ranks' tokens goes to rank 1's experts, so rank 0's receive nothing: it
/// still runs every exchange, forward and backward (none waits), and the outputs and input
/// gradients are right; also with each expert split over 2 tensor-parallel ranks.
#[test]
fn a_rank_whose_experts_receive_nothing_neither_hangs_nor_loses_gradients() {
    for etp in [1, 2] {
        let results = burn_comm::launch_with(
            burn_comm::LaunchConfig::new(2 * etp).with_timeout(std::time::Duration::from_secs(20)),
            |ctx| {
                let (e, t) = (ctx.rank() / etp, ctx.rank() % etp);
                let world = ctx.world();
                let ep_comm = Some(world.split("ep", t)?);
                let etp_comm = (etp > 1).then(|| world.split("etp", e)).transpose()?;
                let split = ExpertParallel::new(EXPERTS, ep_comm)?.with_tensor_parallel(etp_comm);
                let tokens = 3;
                let ids: Vec<i64> = (0..tokens as i64).flat_map(|t| [4 + t, 7]).collect();
                let routing = Routing::<B> {
                    experts: Tensor::from_data(
                        TensorData::new(ids, [tokens, 2]),
                        &Default::default(),
                    ),
                    weights: Tensor::from_data(
                        TensorData::new(vec![0.5f32; 2 * tokens], [tokens, 2]),
                        &Default::default(),
                    ),
                };
                let x = random([tokens, HIDDEN], 60 + e as u64);
                let leaf = Tensor::<B, 2>::from_inner(x.clone()).require_grad();
                let mut idle = Vec::new();
                let (out, _) = dispatch_combine(
                    leaf.clone(),
                    &routing,
                    &split,
                    None,
                    Dispatch::Unpadded,
                    |j, rows| {
                        if rows.dims()[0] == 0 {
                            idle.push(j);
                        }
                        // Each of the `etp` ranks gives its part of the product, which they sum.
                        Ok(rows * (3.0 / etp as f64))
                    },
                )?;
                let grads = out.clone().sum().backward();
                Ok::<_, MoeError>((e, idle, x, out.inner(), leaf.grad(&grads)))
            },
        );
        for (rank, result) in results.into_iter().enumerate() {
            let (e, idle, x, out, grad) =
                result.unwrap_or_else(|err| panic!("etp {etp}, rank {rank}: {err}"));
            // Two copies of weight 1/2 through experts that triple.
            assert_close(&out, &(x * 3.0), &format!("etp {etp}, rank {rank}: output"));
            let grad = grad.expect("an input gradient");
            assert_close(
                &grad,
                &Tensor::ones([3, HIDDEN], &Default::default()).mul_scalar(3.0),
                &format!("etp {etp}, rank {rank}: gradient"),
            );
            if e == 0 {
                assert_eq!(idle, vec![0, 1, 2, 3], "rank {rank}'s experts got nothing");
            } else {
                assert!(idle.is_empty(), "rank {rank}: {idle:?}");
            }
        }
    }
}
