//! Every collective against a single-process reference built from burn's own tensor ops, at
//! world sizes 1, 2, 3, 4 and 8, on random shapes and dimensions. The local transport reduces
//! in rank order, so results must equal the reference bit for bit, on every rank.

mod common;

use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_comm::ReduceOp;
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The reduction of `inputs` in rank order, as one device computes it (half precision in f32,
/// rounded once to nearest, as the transport does; on the host, since burn-flex's cast from f32
/// to bf16 goes through f64 and `half`'s f64 conversion drops the low bits that tell a value
/// just above a tie from the tie: 2312.0005 becomes 2304, half-rs issue 151).
fn reduce_reference<const D: usize>(inputs: &[Tensor<B, D>], op: ReduceOp) -> Tensor<B, D> {
    let dtype = inputs[0].dtype();
    let wide = |t: &Tensor<B, D>| match dtype {
        DType::F16 | DType::BF16 => t.clone().cast(DType::F32),
        _ => t.clone(),
    };
    let mut acc = wide(&inputs[0]);
    for x in &inputs[1..] {
        let x = wide(x);
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::Max => acc.max_pair(x),
            ReduceOp::Min => acc.min_pair(x),
        };
    }
    if op == ReduceOp::Avg {
        acc = acc.div_scalar(inputs.len() as f32);
    }
    let rounded = acc.into_data().convert_dtype(dtype);
    Tensor::from_data(rounded, (&Default::default(), dtype))
}

fn inputs<const D: usize>(
    seed: u64,
    world: usize,
    shape: [usize; D],
    dtype: DType,
) -> Vec<Tensor<B, D>> {
    (0..world)
        .map(|r| random_magnitudes(seed * 1000 + r as u64, shape, dtype))
        .collect()
}

fn check_all_reduce<const D: usize>(
    seed: u64,
    world: usize,
    shape: [usize; D],
    dtype: DType,
    op: ReduceOp,
) {
    let xs = inputs(seed, world, shape, dtype);
    let expected = reduce_reference(&xs, op).into_data();
    let results = run(world, |ctx| {
        let x = xs[ctx.rank()].clone();
        Ok(ctx.world().all_reduce(x, op)?.into_data())
    });
    for (rank, actual) in results.iter().enumerate() {
        let what = format!("all_reduce({op}) {dtype:?} {shape:?} world {world} rank {rank}");
        assert_bits_eq(actual, &expected, &what);
    }
}

#[test]
fn all_reduce_matches_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    for world in WORLD_SIZES {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let seed = rng.random();
            check_all_reduce::<1>(
                seed,
                world,
                random_shape(&mut rng, 300, 0, 1),
                DType::F32,
                op,
            );
            check_all_reduce::<2>(
                seed,
                world,
                random_shape(&mut rng, 40, 0, 1),
                DType::F32,
                op,
            );
            check_all_reduce::<3>(
                seed,
                world,
                random_shape(&mut rng, 12, 0, 1),
                DType::F32,
                op,
            );
        }
    }
}

#[test]
fn all_reduce_of_large_odd_tensors_is_bit_identical_on_every_rank() {
    // 100_003 elements: several reduction blocks per rank and slices that do not split evenly.
    for world in [3, 8] {
        check_all_reduce::<1>(7, world, [100_003], DType::F32, ReduceOp::Sum);
        check_all_reduce::<2>(8, world, [317, 331], DType::F64, ReduceOp::Avg);
    }
}

#[test]
fn all_reduce_half_precision_matches_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    for world in WORLD_SIZES {
        for dtype in [DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let shape = random_shape::<2>(&mut rng, 50, 0, 1);
                check_all_reduce(rng.random(), world, shape, dtype, op);
            }
        }
    }
}

#[test]
fn all_reduce_of_integers_matches_reference() {
    for world in WORLD_SIZES {
        let xs: Vec<Tensor<B, 2, Int>> = (0..world)
            .map(|r| {
                let values: Vec<i32> = (0..12).map(|i| (i * 7 + r as i32 * 13) % 23 - 11).collect();
                Tensor::from_data(TensorData::new(values, [3, 4]), &Default::default())
            })
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let mut expected = xs[0].clone();
            for x in &xs[1..] {
                expected = match op {
                    ReduceOp::Sum => expected + x.clone(),
                    ReduceOp::Max => expected.max_pair(x.clone()),
                    _ => expected.min_pair(x.clone()),
                };
            }
            let expected = expected.into_data();
            let results = run(world, |ctx| {
                Ok(ctx
                    .world()
                    .all_reduce(xs[ctx.rank()].clone(), op)?
                    .into_data())
            });
            for actual in &results {
                assert_bits_eq(
                    actual,
                    &expected,
                    &format!("int all_reduce({op}) world {world}"),
                );
            }
        }
    }
}

fn check_all_gather<const D: usize>(
    seed: u64,
    world: usize,
    shape: [usize; D],
    dim: usize,
    dtype: DType,
) {
    let xs = inputs(seed, world, shape, dtype);
    let expected = Tensor::cat(xs.clone(), dim).into_data();
    let results = run(world, |ctx| {
        Ok(ctx
            .world()
            .all_gather(xs[ctx.rank()].clone(), dim)?
            .into_data())
    });
    for (rank, actual) in results.iter().enumerate() {
        assert_bits_eq(
            actual,
            &expected,
            &format!("all_gather dim {dim} {shape:?} world {world} rank {rank}"),
        );
    }
}

#[test]
fn all_gather_matches_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    for world in WORLD_SIZES {
        for _ in 0..3 {
            let seed = rng.random();
            check_all_gather::<1>(seed, world, random_shape(&mut rng, 50, 0, 1), 0, DType::F32);
            let dim = rng.random_range(0..2);
            check_all_gather::<2>(
                seed,
                world,
                random_shape(&mut rng, 20, 0, 1),
                dim,
                DType::F32,
            );
            let dim = rng.random_range(0..3);
            check_all_gather::<3>(
                seed,
                world,
                random_shape(&mut rng, 8, 0, 1),
                dim,
                DType::BF16,
            );
        }
    }
}

fn check_reduce_scatter<const D: usize>(
    seed: u64,
    world: usize,
    shape: [usize; D],
    dim: usize,
    op: ReduceOp,
) {
    let xs = inputs(seed, world, shape, DType::F32);
    let full = reduce_reference(&xs, op);
    let part = shape[dim] / world;
    let results = run(world, |ctx| {
        Ok(ctx
            .world()
            .reduce_scatter(xs[ctx.rank()].clone(), op, dim)?
            .into_data())
    });
    for (rank, actual) in results.iter().enumerate() {
        let expected = full.clone().narrow(dim, rank * part, part).into_data();
        assert_bits_eq(
            actual,
            &expected,
            &format!("reduce_scatter({op}) dim {dim} {shape:?} world {world} rank {rank}"),
        );
    }
}

#[test]
fn reduce_scatter_matches_reference() {
    let mut rng = StdRng::seed_from_u64(4);
    for world in WORLD_SIZES {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let seed = rng.random();
            check_reduce_scatter::<1>(seed, world, random_shape(&mut rng, 40, 0, world), 0, op);
            let dim = rng.random_range(0..2);
            check_reduce_scatter::<2>(seed, world, random_shape(&mut rng, 12, dim, world), dim, op);
            let dim = rng.random_range(0..3);
            check_reduce_scatter::<3>(seed, world, random_shape(&mut rng, 6, dim, world), dim, op);
        }
    }
}

/// Splits of `total` rows over `world` ranks, uneven and with empty parts: rank `r` gets
/// `(r * 5 + seed) % 4` rows, the last rank the rest.
fn uneven_splits(seed: usize, world: usize) -> Vec<usize> {
    let mut splits: Vec<usize> = (0..world).map(|r| (r * 5 + seed) % 4).collect();
    if world > 1 {
        splits[world - 1] += 1;
    }
    splits
}

#[test]
fn uneven_reduce_scatter_and_all_gather_match_reference() {
    for world in WORLD_SIZES {
        for (seed, dim) in [(1, 0), (2, 1), (3, 0)] {
            let splits = uneven_splits(seed, world);
            let total: usize = splits.iter().sum();
            let starts: Vec<usize> = (0..world).map(|r| splits[..r].iter().sum()).collect();
            let what = |op: &str, rank: usize| {
                format!("{op} dim {dim} splits {splits:?} world {world} rank {rank}")
            };
            let shape = |rows: usize| {
                let mut shape = [3, 2];
                shape[dim] = rows;
                shape
            };
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let xs = inputs(seed as u64, world, shape(total), DType::F32);
                let full = reduce_reference(&xs, op);
                let results = run(world, |ctx| {
                    let x = xs[ctx.rank()].clone();
                    let part = ctx.world().reduce_scatter_split(x, op, dim, &splits)?;
                    Ok(part.into_data())
                });
                for (rank, actual) in results.iter().enumerate() {
                    assert_eq!(
                        actual.shape.to_vec(),
                        shape(splits[rank]).to_vec(),
                        "{}",
                        what("reduce_scatter_split", rank)
                    );
                    if splits[rank] > 0 {
                        let expected = full.clone().narrow(dim, starts[rank], splits[rank]);
                        assert_bits_eq(
                            actual,
                            &expected.into_data(),
                            &what("reduce_scatter_split", rank),
                        );
                    }
                }
            }
            let parts: Vec<Tensor<B, 2>> = (0..world)
                .map(|r| random(seed as u64 * 10 + r as u64, shape(splits[r]), DType::F32))
                .collect();
            let expected = Tensor::cat(parts.clone(), dim).into_data();
            let results = run(world, |ctx| {
                let x = parts[ctx.rank()].clone();
                Ok(ctx.world().all_gather_split(x, dim, &splits)?.into_data())
            });
            for (rank, actual) in results.iter().enumerate() {
                assert_bits_eq(actual, &expected, &what("all_gather_split", rank));
            }
        }
    }
}

#[test]
fn uneven_splits_that_differ_between_ranks_fail_on_every_rank() {
    let outcomes = burn_comm::launch(3, |ctx| {
        let comm = ctx.world();
        let x = random(7, [6, 2], DType::F32);
        // Rank 2 says [1, 2, 3] where the others say [2, 2, 2]: the same total and shapes.
        let splits = match ctx.rank() {
            2 => vec![1, 2, 3],
            _ => vec![2, 2, 2],
        };
        let differ = comm
            .reduce_scatter_split(x.clone(), ReduceOp::Sum, 0, &splits)
            .map(drop)
            .expect_err("splits that differ are refused")
            .to_string();
        // Rank 1's splits do not add up to its rows; the others learn that it refused.
        let splits = match ctx.rank() {
            1 => vec![2, 2, 1],
            _ => vec![2, 2, 2],
        };
        let bad = comm
            .reduce_scatter_split(x.clone(), ReduceOp::Sum, 0, &splits)
            .map(drop)
            .expect_err("a bad split is refused")
            .to_string();
        // An all-gather whose part is not the rank's split.
        let short = comm
            .all_gather_split(random(8, [2, 2], DType::F32), 0, &[2, 3, 2])
            .map(drop)
            .expect_err("a part of another size is refused")
            .to_string();
        // The group still works afterwards.
        let part = random(9, [ctx.rank(), 2], DType::F32);
        let fine = comm.all_gather_split(part, 0, &[0, 1, 2])?;
        Ok::<_, burn_comm::CommError>((differ, bad, short, fine.dims()))
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let (differ, bad, short, fine) = outcome.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            differ.contains("passed the splits"),
            "rank {rank}: {differ}"
        );
        let expected = match rank {
            1 => "add up to 5 but the tensor has 6",
            _ => "ranks [1] of the group passed arguments they refused",
        };
        assert!(bad.contains(expected), "rank {rank}: {bad}");
        let expected = match rank {
            1 => "split is 3 rows but its tensor has 2",
            _ => "ranks [1] of the group",
        };
        assert!(short.contains(expected), "rank {rank}: {short}");
        assert_eq!(fine, [3, 2]);
    }
}

#[test]
fn broadcast_from_every_root() {
    for world in WORLD_SIZES {
        for root in 0..world {
            let xs = inputs(root as u64, world, [5, 3], DType::F32);
            let expected = xs[root].to_data();
            let results = run(world, |ctx| {
                Ok(ctx
                    .world()
                    .broadcast(xs[ctx.rank()].clone(), root)?
                    .into_data())
            });
            for actual in &results {
                assert_bits_eq(
                    actual,
                    &expected,
                    &format!("broadcast root {root} world {world}"),
                );
            }
        }
    }
}

fn check_all_to_all<const D: usize>(
    seed: u64,
    world: usize,
    shape: [usize; D],
    split: usize,
    concat: usize,
) {
    let xs = inputs(seed, world, shape, DType::F32);
    let part = shape[split] / world;
    let results = run(world, |ctx| {
        Ok(ctx
            .world()
            .all_to_all(xs[ctx.rank()].clone(), split, concat)?
            .into_data())
    });
    for (rank, actual) in results.iter().enumerate() {
        let parts = xs
            .iter()
            .map(|x| x.clone().narrow(split, rank * part, part))
            .collect();
        let expected = Tensor::cat(parts, concat).into_data();
        let what =
            format!("all_to_all split {split} concat {concat} {shape:?} world {world} rank {rank}");
        assert_bits_eq(actual, &expected, &what);
    }
}

#[test]
fn all_to_all_matches_reference() {
    let mut rng = StdRng::seed_from_u64(5);
    for world in WORLD_SIZES {
        for _ in 0..3 {
            let seed = rng.random();
            check_all_to_all::<1>(seed, world, random_shape(&mut rng, 10, 0, world), 0, 0);
            let (split, concat) = (rng.random_range(0..2), rng.random_range(0..2));
            check_all_to_all::<2>(
                seed,
                world,
                random_shape(&mut rng, 7, split, world),
                split,
                concat,
            );
            let (split, concat) = (rng.random_range(0..3), rng.random_range(0..3));
            check_all_to_all::<3>(
                seed,
                world,
                random_shape(&mut rng, 5, split, world),
                split,
                concat,
            );
        }
    }
}

#[test]
fn send_and_recv_around_a_ring_keep_order() {
    for world in [2, 3, 4, 8] {
        let results = run(world, |ctx| {
            let comm = ctx.world();
            let (next, prev) = ((ctx.rank() + 1) % world, (ctx.rank() + world - 1) % world);
            for i in 0..3 {
                comm.send(
                    random::<2>((ctx.rank() * 10 + i) as u64, [4, 2], DType::F32),
                    next,
                )?;
            }
            let mut got = Vec::new();
            for _ in 0..3 {
                got.push(
                    comm.recv::<B, 2, burn::tensor::Float>(prev, [4, 2], &Default::default())?
                        .into_data(),
                );
            }
            Ok((prev, got))
        });
        for (prev, got) in results {
            for (i, actual) in got.iter().enumerate() {
                let expected = random::<2>((prev * 10 + i) as u64, [4, 2], DType::F32).into_data();
                assert_bits_eq(
                    actual,
                    &expected,
                    &format!("message {i} from rank {prev} of {world}"),
                );
            }
        }
    }
}

#[test]
fn ints_and_bools_are_sent_as_they_are() {
    let results = run(2, |ctx| {
        let (comm, peer) = (ctx.world(), 1 - ctx.rank());
        let ints = |rank: usize| {
            Tensor::<B, 1, Int>::arange(0..6, &Default::default()) * (rank as i64 + 1)
        };
        comm.send(ints(ctx.rank()), peer)?;
        comm.send(ints(ctx.rank()).greater_elem(3), peer)?;
        let got: Tensor<B, 1, Int> = comm.recv(peer, [6], &Default::default())?;
        let flags: Tensor<B, 1, burn::tensor::Bool> = comm.recv(peer, [6], &Default::default())?;
        assert_bits_eq(&got.into_data(), &ints(peer).into_data(), "ints");
        assert_bits_eq(
            &flags.into_data(),
            &ints(peer).greater_elem(3).into_data(),
            "bools",
        );
        Ok(())
    });
    assert_eq!(results.len(), 2);
}

#[test]
fn async_calls_complete_in_issue_order() {
    for world in [1, 2, 4] {
        let xs = inputs(9, world, [64, 8], DType::F32);
        let expected_sum = reduce_reference(&xs, ReduceOp::Sum).into_data();
        let expected_gather = Tensor::cat(xs.clone(), 1).into_data();
        let results = run(world, |ctx| {
            let comm = ctx.world();
            let x = xs[ctx.rank()].clone();
            let sum = comm.all_reduce_async(x.clone(), ReduceOp::Sum);
            let gather = comm.all_gather_async(x.clone(), 1);
            let barrier = comm.barrier_async();
            // Work on this thread while the collectives run on the communication stream.
            let local = (x.clone() * 2.0).sum().into_scalar();
            barrier.wait()?;
            Ok((gather.wait()?.into_data(), sum.wait()?.into_data(), local))
        });
        for (gather, sum, _) in &results {
            assert_bits_eq(sum, &expected_sum, "async all_reduce");
            assert_bits_eq(gather, &expected_gather, "async all_gather");
        }
    }
}

#[test]
fn an_async_call_returns_before_its_peers_join() {
    let results = run(3, |ctx| {
        let x = Tensor::<B, 1>::from_floats([ctx.rank() as f32 + 1.0], &Default::default());
        Ok(sum_joined_after_an_async_start(ctx.world(), x)?.into_scalar())
    });
    assert_eq!(results, vec![6.0; 3]);
}

#[test]
fn split_forms_groups_by_colour() {
    let results = run(6, |ctx| {
        let comm = ctx.world().split("parity", ctx.rank() % 2)?;
        let x = Tensor::<B, 1>::from_floats([ctx.rank() as f32], &Default::default());
        let sum = comm.all_reduce(x, ReduceOp::Sum)?.into_scalar();
        Ok((comm.ranks().to_vec(), comm.rank(), sum))
    });
    for (rank, (members, local, sum)) in results.into_iter().enumerate() {
        let expected: Vec<usize> = (0..6).filter(|r| r % 2 == rank % 2).collect();
        assert_eq!(local, expected.iter().position(|&r| r == rank).unwrap());
        assert_eq!(sum, expected.iter().sum::<usize>() as f32);
        assert_eq!(members, expected);
    }
}

#[test]
fn mesh_groups_vary_tp_fastest() {
    let results = run(8, |ctx| {
        let mesh = ctx.mesh(&[("dp", 2), ("pp", 2), ("tp", 2)])?;
        let x = Tensor::<B, 1>::from_floats([ctx.rank() as f32], &Default::default());
        let tp_sum = mesh
            .group("tp")?
            .all_reduce(x, ReduceOp::Sum)?
            .into_scalar();
        let members = |n| mesh.group(n).map(|c| c.ranks().to_vec());
        Ok((
            members("dp")?,
            members("pp")?,
            members("tp")?,
            tp_sum,
            mesh.coord("pp")?,
        ))
    });
    let (dp, pp, tp, tp_sum, pp_coord) = &results[5];
    // Rank 5 sits at dp=1, pp=0, tp=1.
    assert_eq!(dp, &vec![1, 5]);
    assert_eq!(pp, &vec![5, 7]);
    assert_eq!(tp, &vec![4, 5]);
    assert_eq!(*tp_sum, 9.0);
    assert_eq!(*pp_coord, 0);
}

#[test]
fn mesh_rejects_a_product_that_is_not_the_world_size() {
    let results = run(4, |ctx| {
        Ok(ctx.mesh(&[("dp", 2), ("tp", 3)]).unwrap_err().to_string())
    });
    assert_eq!(
        results[0],
        "the mesh dp=2 x tp=3 has 6 ranks but the world has 4; choose sizes whose product is 4"
    );
    let results = run(2, |ctx| {
        let mesh = ctx.mesh(&[("dp", 2)])?;
        Ok(mesh.group("tp").unwrap_err().to_string())
    });
    assert!(results[0].contains("no dimension 'tp'"), "{}", results[0]);
}

#[test]
fn shared_results_are_copied_on_write() {
    // Broadcast and all-gather results share one buffer between ranks, and all-reduce writes
    // into peers' buffers; either way, a rank that changes its result in place must not
    // change its peers'.
    let xs = inputs(11, 3, [64], DType::F32);
    let expected = [
        reduce_reference(&xs, ReduceOp::Sum).into_data(),
        xs[0].to_data(),
        Tensor::cat(xs.clone(), 0).into_data(),
    ];
    let results = run(3, |ctx| {
        let comm = ctx.world();
        let x = xs[ctx.rank()].clone();
        let results = [
            comm.all_reduce(x.clone(), ReduceOp::Sum)?,
            comm.broadcast(x.clone(), 0)?,
            comm.all_gather(x, 0)?,
        ];
        comm.barrier()?;
        // Rank 1 writes into its results; the others read theirs afterwards.
        let results = results.map(|t| {
            if ctx.rank() == 1 {
                t.mul_scalar(0.0).add_scalar(5.0)
            } else {
                t
            }
        });
        comm.barrier()?;
        Ok(results.map(|t| t.into_data()))
    });
    for (rank, got) in results.iter().enumerate() {
        for (actual, expected) in got.iter().zip(&expected) {
            if rank == 1 {
                assert!(actual.to_vec::<f32>().unwrap().iter().all(|&v| v == 5.0));
            } else {
                assert_bits_eq(actual, expected, &format!("rank {rank}"));
            }
        }
    }
}

#[test]
fn collectives_work_on_another_backend() {
    // NdArray stores tensors its own way; the transport only sees host data.
    use burn::backend::{Autodiff, NdArray};
    type N = NdArray<f32>;
    let world = 3;
    let xs: Vec<TensorData> = inputs::<2>(21, world, [6, 4], DType::F32)
        .into_iter()
        .map(|t| t.into_data())
        .collect();
    let flex: Vec<Tensor<B, 2>> = xs
        .iter()
        .map(|d| Tensor::from_data(d.clone(), &Default::default()))
        .collect();
    let expected = [
        reduce_reference(&flex, ReduceOp::Sum).into_data(),
        Tensor::cat(flex.clone(), 1).into_data(),
        flex[2].to_data(),
    ];
    let max = reduce_reference(&flex, ReduceOp::Max);
    let results = run(world, |ctx| {
        let comm = ctx.world();
        let x = Tensor::<N, 2>::from_data(xs[ctx.rank()].clone(), &Default::default());
        let scattered = comm.reduce_scatter(x.clone(), ReduceOp::Max, 0)?;
        let exchanged = comm.all_to_all(x.clone(), 0, 1)?;
        let ad = Tensor::<Autodiff<N>, 2>::from_inner(x.clone()).require_grad();
        let reduced = burn_comm::parallel::reduce_from_parallel_region(ad.clone(), comm)?;
        let grad = ad.grad(&reduced.sum().backward()).unwrap();
        Ok([
            comm.all_reduce(x.clone(), ReduceOp::Sum)?.into_data(),
            comm.all_gather(x.clone(), 1)?.into_data(),
            scattered.into_data(),
            comm.broadcast(x, 2)?.into_data(),
            exchanged.into_data(),
            grad.into_data(),
        ])
    });
    for (rank, [sum, gathered, scattered, bcast, exchanged, grad]) in results.iter().enumerate() {
        assert_bits_eq(sum, &expected[0], "ndarray all_reduce");
        assert_bits_eq(gathered, &expected[1], "ndarray all_gather");
        let part = max.clone().narrow(0, rank * 2, 2).into_data();
        assert_bits_eq(scattered, &part, "ndarray reduce_scatter");
        assert_bits_eq(bcast, &expected[2], "ndarray broadcast");
        let parts = flex
            .iter()
            .map(|x| x.clone().narrow(0, rank * 2, 2))
            .collect();
        assert_bits_eq(
            exchanged,
            &Tensor::cat(parts, 1).into_data(),
            "ndarray all_to_all",
        );
        assert_eq!(
            grad.to_vec::<f32>().unwrap(),
            vec![1.0; 24],
            "ndarray reduce backward"
        );
    }
}

#[test]
fn empty_tensors_pass_through_every_collective() {
    let results = run(2, |ctx| {
        let comm = ctx.world();
        let empty = || {
            Tensor::<B, 2>::from_data(
                TensorData::new(Vec::<f32>::new(), [0, 4]),
                &Default::default(),
            )
        };
        Ok([
            comm.all_reduce(empty(), ReduceOp::Sum)?.dims(),
            comm.all_gather(empty(), 0)?.dims(),
            comm.all_gather(empty(), 1)?.dims(),
            comm.reduce_scatter(empty(), ReduceOp::Sum, 1)?.dims(),
            comm.broadcast(empty(), 1)?.dims(),
            comm.all_to_all(empty(), 1, 0)?.dims(),
        ])
    });
    for dims in results {
        assert_eq!(dims, [[0, 4], [0, 4], [0, 8], [0, 2], [0, 4], [0, 2]]);
    }
}

#[test]
fn a_blocking_call_waits_for_the_async_calls_issued_before_it() {
    // Blocking calls run on the caller's thread when the stream is idle; behind a pending
    // async call they must queue, or ranks would pair different calls.
    for world in [2, 3] {
        let xs = inputs(13, world, [32, 4], DType::F32);
        let expected_sum = reduce_reference(&xs, ReduceOp::Sum).into_data();
        let expected_gather = Tensor::cat(xs.clone(), 0).into_data();
        let results = run(world, |ctx| {
            let comm = ctx.world();
            let x = xs[ctx.rank()].clone();
            if ctx.rank() == 0 {
                // Both blocking, in order.
                let sum = comm.all_reduce(x.clone(), ReduceOp::Sum)?;
                let gathered = comm.all_gather(x, 0)?;
                Ok((sum.into_data(), gathered.into_data()))
            } else {
                // Async first, then a blocking call before waiting on it.
                let sum = comm.all_reduce_async(x.clone(), ReduceOp::Sum);
                let gathered = comm.all_gather(x, 0)?;
                Ok((sum.wait()?.into_data(), gathered.into_data()))
            }
        });
        for (sum, gathered) in &results {
            assert_bits_eq(sum, &expected_sum, "all_reduce issued first");
            assert_bits_eq(gathered, &expected_gather, "all_gather issued second");
        }
    }
}

#[test]
fn stats_count_calls_and_payload_bytes_per_kind_of_collective() {
    let results = burn_comm::launch(2, |ctx| {
        let comm = ctx.world();
        let x = Tensor::<B, 2>::zeros([4, 8], &Default::default());
        comm.all_reduce(x.clone(), ReduceOp::Sum)?;
        comm.all_reduce(x.clone(), ReduceOp::Max)?;
        comm.all_gather(x.clone(), 0)?;
        comm.reduce_scatter(x.clone(), ReduceOp::Sum, 1)?;
        comm.barrier()?;
        let stats = comm.stats();
        comm.reset_stats();
        Ok::<_, burn_comm::CommError>((stats, comm.stats()))
    });
    for result in results {
        let (stats, reset) = result.unwrap();
        assert_eq!(
            (stats.all_reduce.calls, stats.all_reduce.bytes),
            (2, 2 * 128)
        );
        assert_eq!((stats.all_gather.calls, stats.all_gather.bytes), (1, 128));
        assert_eq!(
            (stats.reduce_scatter.calls, stats.reduce_scatter.bytes),
            (1, 128)
        );
        assert_eq!(stats.broadcast.calls + stats.send.calls, 0);
        // Ring algorithm at 2 ranks: an all-reduce sends its message once, an all-gather its
        // part once, a reduce-scatter half its input.
        assert_eq!(stats.ring_bytes(2), 256.0 + 128.0 + 64.0);
        assert_eq!(reset, burn_comm::CommStats::default());
    }
}

#[test]
fn a_host_group_is_its_own_host_twin() {
    let results = run(2, |ctx| {
        let host = ctx
            .world()
            .host()
            .expect("a group of threads is on the host");
        assert!(!host.is_nccl());
        assert_eq!(
            (host.group_name(), host.ranks(), host.rank()),
            (ctx.world().group_name(), ctx.world().ranks(), ctx.rank())
        );
        // The same group: a collective on either is one call of the group.
        let x = Tensor::<B, 1>::from_floats([ctx.rank() as f32], &Default::default());
        let sum = host.all_reduce(x, ReduceOp::Sum)?;
        Ok(sum.into_scalar())
    });
    assert!(results.into_iter().all(|sum| sum == 1.0));
}
