//! The autodiff-aware region operations, forward and backward, against their mathematical
//! definitions at world sizes 1, 2 and 4.
//!
//! Each rank computes `L_k = sum(w_k * op(x_k))`; the gradient checked is that of the total
//! loss `sum_k L_k` with respect to `x_k`. Where an operation's output is replicated
//! (reduce, gather) the downstream weights are replicated too (`w_k = w`), so there is one
//! loss, as in Megatron-LM.

mod common;

use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor, TensorData};
use burn_comm::parallel::{self, CommBackend, RegionOp};
use burn_comm::{Communicator, launch_with};
use common::*;

type AD = Autodiff<B>;

fn apply<Be: CommBackend>(op: RegionOp, x: Tensor<Be, 2>, comm: &Communicator) -> Tensor<Be, 2> {
    let y = match op {
        RegionOp::Copy => parallel::copy_to_parallel_region(x, comm),
        RegionOp::Reduce => parallel::reduce_from_parallel_region(x, comm),
        RegionOp::Scatter { dim } => parallel::scatter_to_parallel_region(x, comm, dim),
        RegionOp::Gather { dim } => parallel::gather_from_parallel_region(x, comm, dim),
        RegionOp::SequenceGather { dim } => {
            parallel::gather_from_sequence_parallel_region(x, comm, dim)
        }
        RegionOp::SequenceReduceScatter { dim } => {
            parallel::reduce_scatter_to_sequence_parallel_region(x, comm, dim)
        }
    };
    y.expect("region op")
}

fn sum_in_order(xs: &[Tensor<B, 2>]) -> Tensor<B, 2> {
    xs[1..].iter().fold(xs[0].clone(), |acc, x| acc + x.clone())
}

fn part(x: &Tensor<B, 2>, dim: usize, rank: usize, world: usize) -> Tensor<B, 2> {
    let len = x.dims()[dim] / world;
    x.clone().narrow(dim, rank * len, len)
}

/// Inputs, weights, and the expected outputs and gradients of every rank.
struct Case {
    x: Vec<Tensor<B, 2>>,
    w: Vec<Tensor<B, 2>>,
    y: Vec<Tensor<B, 2>>,
    grad: Vec<Tensor<B, 2>>,
}

fn case(op: RegionOp, world: usize) -> Case {
    let full = [2 * world, 3 * world];
    let mut half = full;
    let rand = |seed: u64, shape: [usize; 2]| random::<2>(seed, shape, DType::F32);
    let per_rank = |base: u64, shape| {
        (0..world)
            .map(|r| rand(base + r as u64, shape))
            .collect::<Vec<_>>()
    };
    let replicated = |seed: u64, shape| vec![rand(seed, shape); world];
    let ranks = 0..world;
    match op {
        RegionOp::Copy => {
            let (x, w) = (replicated(1, full), per_rank(10, full));
            let grad = vec![sum_in_order(&w); world];
            Case {
                y: x.clone(),
                x,
                w,
                grad,
            }
        }
        RegionOp::Reduce => {
            let (x, w) = (per_rank(20, full), replicated(2, full));
            let y = vec![sum_in_order(&x); world];
            Case {
                grad: w.clone(),
                x,
                w,
                y,
            }
        }
        RegionOp::Scatter { dim } => {
            half[dim] /= world;
            let (x, w) = (replicated(3, full), per_rank(30, half));
            let y = ranks.map(|r| part(&x[0], dim, r, world)).collect();
            let grad = vec![Tensor::cat(w.clone(), dim); world];
            Case { x, w, y, grad }
        }
        RegionOp::Gather { dim } => {
            half[dim] /= world;
            let (x, w) = (per_rank(40, half), replicated(4, full));
            let y = vec![Tensor::cat(x.clone(), dim); world];
            let grad = ranks.map(|r| part(&w[0], dim, r, world)).collect();
            Case { x, w, y, grad }
        }
        RegionOp::SequenceGather { dim } => {
            half[dim] /= world;
            let (x, w) = (per_rank(50, half), per_rank(60, full));
            let y = vec![Tensor::cat(x.clone(), dim); world];
            let total = sum_in_order(&w);
            let grad = ranks.map(|r| part(&total, dim, r, world)).collect();
            Case { x, w, y, grad }
        }
        RegionOp::SequenceReduceScatter { dim } => {
            half[dim] /= world;
            let (x, w) = (per_rank(70, full), per_rank(80, half));
            let total = sum_in_order(&x);
            let y = ranks.map(|r| part(&total, dim, r, world)).collect();
            let grad = vec![Tensor::cat(w.clone(), dim); world];
            Case { x, w, y, grad }
        }
    }
}

const OPS: [RegionOp; 10] = [
    RegionOp::Copy,
    RegionOp::Reduce,
    RegionOp::Scatter { dim: 0 },
    RegionOp::Scatter { dim: 1 },
    RegionOp::Gather { dim: 0 },
    RegionOp::Gather { dim: 1 },
    RegionOp::SequenceGather { dim: 0 },
    RegionOp::SequenceGather { dim: 1 },
    RegionOp::SequenceReduceScatter { dim: 0 },
    RegionOp::SequenceReduceScatter { dim: 1 },
];

#[test]
fn region_ops_have_the_right_forward_and_gradient() {
    for world in [1, 2, 4] {
        for op in OPS {
            let case = case(op, world);
            let results = run(world, |ctx| {
                let r = ctx.rank();
                let x = Tensor::<AD, 2>::from_inner(case.x[r].clone()).require_grad();
                let y = apply(op, x.clone(), ctx.world());
                let loss = (y.clone() * Tensor::from_inner(case.w[r].clone())).sum();
                let grads = loss.backward();
                let grad = x.grad(&grads).expect("x has a gradient");
                Ok((y.inner().into_data(), grad.into_data()))
            });
            for (r, (y, grad)) in results.iter().enumerate() {
                let what = format!("{op:?} world {world} rank {r}");
                assert_bits_eq(y, &case.y[r].to_data(), &format!("{what}: forward"));
                assert_bits_eq(grad, &case.grad[r].to_data(), &format!("{what}: gradient"));
            }
        }
    }
}

#[test]
fn without_autodiff_only_the_forward_runs() {
    for op in OPS {
        let case = case(op, 2);
        let results = run(2, |ctx| {
            Ok(apply(op, case.x[ctx.rank()].clone(), ctx.world()).into_data())
        });
        for (r, y) in results.iter().enumerate() {
            assert_bits_eq(y, &case.y[r].to_data(), &format!("{op:?} rank {r}"));
        }
    }
}

#[test]
fn a_tensor_that_needs_no_gradient_still_communicates() {
    let results = run(2, |ctx| {
        let x =
            Tensor::<AD, 2>::ones([2, 2], &Default::default()).mul_scalar(ctx.rank() as f32 + 1.0);
        let y = parallel::reduce_from_parallel_region(x, ctx.world())?;
        Ok(y.into_data())
    });
    for y in results {
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![3.0; 4]);
    }
}

#[test]
fn column_then_row_parallel_matmul_matches_the_dense_one() {
    // The Megatron MLP pattern: f, X * A_k (columns of A), * B_k (rows of B), g.
    let world = 2;
    let x = random::<2>(1, [3, 4], DType::F32);
    let a = random::<2>(2, [4, 6], DType::F32);
    let b = random::<2>(3, [6, 5], DType::F32);
    let dense = || {
        let x = Tensor::<AD, 2>::from_inner(x.clone()).require_grad();
        let out = x
            .clone()
            .matmul(Tensor::from_inner(a.clone()))
            .matmul(Tensor::from_inner(b.clone()));
        let grads = out.clone().sum().backward();
        (out.inner(), x.grad(&grads).unwrap())
    };
    let (out, grad) = dense();
    let results = run(world, |ctx| {
        let comm = ctx.world();
        let r = ctx.rank();
        let x = Tensor::<AD, 2>::from_inner(x.clone()).require_grad();
        let a = Tensor::<AD, 2>::from_inner(part(&a, 1, r, world));
        let b = Tensor::<AD, 2>::from_inner(part(&b, 0, r, world));
        let h = parallel::copy_to_parallel_region(x.clone(), comm)?.matmul(a);
        let out = parallel::reduce_from_parallel_region(h.matmul(b), comm)?;
        let grads = out.clone().sum().backward();
        Ok((out.inner(), x.grad(&grads).unwrap()))
    });
    for (o, g) in results {
        // The sharded matmuls add in another order than the dense one: compare to f32 rounding.
        o.into_data()
            .assert_approx_eq::<f32>(&out.to_data(), burn::tensor::Tolerance::rel_abs(1e-5, 1e-6));
        g.into_data().assert_approx_eq::<f32>(
            &grad.to_data(),
            burn::tensor::Tolerance::rel_abs(1e-5, 1e-6),
        );
    }
}

/// Rows rank `from` sends rank `to` in the uneven all-to-all below: some parts are empty.
fn rows(from: usize, to: usize) -> usize {
    (from + 2 * to) % 3
}

/// `all_to_all_split` with parts of every size, empty ones included: forward, rank `q` gets
/// rank `r`'s part for it, in rank order; backward, each part's gradient goes back to its rank.
#[test]
fn an_uneven_all_to_all_moves_every_part_and_sends_its_gradient_back() {
    for world in [1, 2, 3, 4] {
        // Each rank's rows for each destination, in order, valued so a row says where it is.
        let input = |r: usize| {
            let values: Vec<f32> = (0..world)
                .flat_map(|q| (0..rows(r, q)).map(move |i| (100 * r + 10 * q + i) as f32))
                .collect();
            let n = values.len();
            Tensor::<B, 2>::from_data(TensorData::new(values, [n, 1]), &Default::default())
        };
        let results = run(world, |ctx| {
            let (r, comm) = (ctx.rank(), ctx.world());
            let sizes = parallel::SplitSizes {
                send: (0..world).map(|q| rows(r, q)).collect(),
                recv: (0..world).map(|q| rows(q, r)).collect(),
            };
            let x = Tensor::<AD, 2>::from_inner(input(r)).require_grad();
            let y = parallel::all_to_all_split(x.clone(), 0, &sizes, comm)?;
            // A weight per received row, its value: each source row's gradient is its own value.
            let grads = (y.clone() * y.clone().detach()).sum().backward();
            Ok((y.inner(), x.grad(&grads)))
        });
        for (q, (y, grad)) in results.into_iter().enumerate() {
            let expected: Vec<f32> = (0..world)
                .flat_map(|r| (0..rows(r, q)).map(move |i| (100 * r + 10 * q + i) as f32))
                .collect();
            let got: Vec<f32> = y.into_data().to_vec().unwrap();
            assert_eq!(got, expected, "world {world}: rank {q} received");
            let own: Vec<f32> = input(q).into_data().to_vec().unwrap();
            match grad {
                Some(grad) => {
                    let grad: Vec<f32> = grad.into_data().to_vec().unwrap();
                    assert_eq!(grad, own, "world {world}: rank {q}'s gradient");
                }
                None => assert!(own.is_empty(), "world {world}: rank {q} has a gradient"),
            }
        }
    }
}

#[test]
fn an_uneven_all_to_all_whose_sizes_disagree_fails_naming_them() {
    let results = launch_with(
        burn_comm::LaunchConfig::new(2).with_timeout(std::time::Duration::from_secs(20)),
        |ctx| {
            // Rank 0 sends rank 1 two rows, rank 1 expects one.
            let sizes = match ctx.rank() {
                0 => parallel::SplitSizes {
                    send: vec![1, 2],
                    recv: vec![1, 0],
                },
                _ => parallel::SplitSizes {
                    send: vec![0, 1],
                    recv: vec![1, 1],
                },
            };
            let rows = sizes.send.iter().sum();
            let x = Tensor::<B, 2>::zeros([rows, 3], &Default::default());
            ctx.world().all_to_all_split(x, 0, &sizes).map(drop)
        },
    );
    let text: Vec<String> = results
        .into_iter()
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    assert!(
        text.iter()
            .any(|e| e.contains("[2, 3]") && e.contains("[1, 3]")),
        "{text:?}"
    );
}
