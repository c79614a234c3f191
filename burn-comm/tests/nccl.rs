//! The NCCL transport against the local transport, on one GPU (device 0) shared by the ranks.
//!
//! On a machine without an NVIDIA driver or NCCL these tests check the error that says so,
//! unless `BURN_COMM_REQUIRE_GPU=1` (set by `scripts/gpu/run.sh`) makes that a failure. Two
//! ranks on one GPU need `NCCL_MULTI_RANK_GPU_ENABLE=1` (NCCL 2.30 or later).
#![cfg(feature = "cuda")]

mod common;

use std::time::Duration;

use burn::backend::Autodiff;
use burn::backend::Flex;
use burn::backend::cuda::{Cuda, CudaDevice};
use burn::tensor::{Int, Tensor, TensorData};
use burn_comm::{CommError, Communicator, LaunchConfig, RankContext, ReduceOp, launch_with};
use common::assert_bits_eq;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type G = Cuda;

fn device() -> CudaDevice {
    CudaDevice::new(0)
}

/// Runs `f` on `world` ranks with the world on NCCL and the same world on the local transport.
/// Without a usable GPU, checks that every rank got the error that says why, and skips `f`.
fn on_nccl<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&RankContext, &Communicator) -> Result<T, CommError> + Sync,
) -> Option<Vec<T>> {
    let results = launch_with(LaunchConfig::new(world).with_timeout(timeout), |ctx| {
        let nccl = ctx.world().nccl(&device())?;
        assert!(nccl.is_nccl() && !ctx.world().is_nccl());
        // Its host twin is the group it was made from; a split of it has none.
        let host = nccl.host().expect("made from a host group");
        assert!(!host.is_nccl() && host.ranks() == ctx.world().ranks());
        f(&ctx, &nccl)
    });
    let required = std::env::var("BURN_COMM_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let mut values = Vec::new();
    for result in results {
        match result {
            Ok(value) => values.push(value),
            Err(burn_comm::RankError::Failed {
                error: CommError::Transport { reason, .. },
                ..
            }) if !required && reason.contains("could not be loaded") => {
                assert!(reason.contains("LD_LIBRARY_PATH"), "{reason}");
                eprintln!("no GPU here, checked the error instead: {reason}");
                return None;
            }
            Err(error) => panic!("{error}"),
        }
    }
    Some(values)
}

const MINUTE: Duration = Duration::from_secs(60);

/// Whole numbers in [-8, 8]: sums of them are exact in any order, so NCCL's and the local
/// transport's reduction orders must agree bit for bit.
fn whole<const D: usize>(seed: u64, shape: [usize; D]) -> Tensor<G, D> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(-8..=8) as f32).collect();
    Tensor::from_data(TensorData::new(values, shape), &device())
}

fn same<const D: usize, K: burn::tensor::BasicOps<G>>(
    nccl: Tensor<G, D, K>,
    local: Tensor<G, D, K>,
    what: &str,
) {
    assert_bits_eq(&nccl.into_data(), &local.into_data(), what);
}

#[test]
fn every_collective_matches_the_local_transport() {
    for world in [1, 2] {
        on_nccl(world, MINUTE, |ctx, nccl| {
            let (rank, local) = (ctx.rank() as u64, ctx.world());
            let x = whole(rank, [4, 6]);
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                same(
                    nccl.all_reduce(x.clone(), op)?,
                    local.all_reduce(x.clone(), op)?,
                    &format!("all_reduce {op} on world {world}"),
                );
            }
            let ints = Tensor::<G, 1, Int>::arange(0..12, &device()).mul_scalar(rank as i64 + 1);
            same(
                nccl.all_reduce(ints.clone(), ReduceOp::Sum)?,
                local.all_reduce(ints, ReduceOp::Sum)?,
                "all_reduce of ints",
            );
            for dim in [0, 1] {
                same(
                    nccl.all_gather(x.clone(), dim)?,
                    local.all_gather(x.clone(), dim)?,
                    &format!("all_gather dim {dim}"),
                );
                same(
                    nccl.reduce_scatter(x.clone(), ReduceOp::Sum, dim)?,
                    local.reduce_scatter(x.clone(), ReduceOp::Sum, dim)?,
                    &format!("reduce_scatter dim {dim}"),
                );
            }
            let root = world - 1;
            same(
                nccl.broadcast(x.clone(), root)?,
                local.broadcast(x.clone(), root)?,
                "broadcast",
            );
            for (split, concat) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                same(
                    nccl.all_to_all(x.clone(), split, concat)?,
                    local.all_to_all(x.clone(), split, concat)?,
                    &format!("all_to_all split {split} concat {concat}"),
                );
            }
            // A strided input (a transposed view) is made contiguous first.
            same(
                nccl.all_gather(x.clone().transpose(), 0)?,
                local.all_gather(x.clone().transpose(), 0)?,
                "all_gather of a transposed tensor",
            );
            let empty = Tensor::<G, 2>::zeros([0, 6], &device());
            same(
                nccl.all_gather(empty.clone(), 1)?,
                local.all_gather(empty.clone(), 1)?,
                "all_gather of an empty tensor",
            );
            same(
                nccl.reduce_scatter(empty.clone(), ReduceOp::Sum, 0)?,
                local.reduce_scatter(empty.clone(), ReduceOp::Sum, 0)?,
                "reduce_scatter along an empty dimension",
            );
            same(
                nccl.all_to_all(empty.clone(), 0, 1)?,
                local.all_to_all(empty, 0, 1)?,
                "all_to_all along an empty dimension",
            );
            nccl.barrier()?;
            Ok(())
        });
    }
}

#[test]
fn random_floats_agree_within_rounding() {
    on_nccl(2, MINUTE, |ctx, nccl| {
        let mut rng = StdRng::seed_from_u64(ctx.rank() as u64);
        let values: Vec<f32> = (0..100_003).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x = Tensor::<G, 1>::from_data(TensorData::new(values, [100_003]), &device());
        let on_nccl = nccl.all_reduce(x.clone(), ReduceOp::Sum)?.into_data();
        let on_local = ctx.world().all_reduce(x, ReduceOp::Sum)?.into_data();
        // Two ranks: a + b in either order rounds the same.
        assert_bits_eq(&on_nccl, &on_local, "sum of two ranks");
        Ok(())
    });
}

#[test]
fn autodiff_tensors_and_async_calls_work() {
    on_nccl(2, MINUTE, |ctx, nccl| {
        let x = whole::<2>(ctx.rank() as u64, [8, 8]);
        let tracked = Tensor::<Autodiff<G>, 2>::from_inner(x.clone()).require_grad();
        let reduced = nccl.all_reduce(tracked, ReduceOp::Sum)?;
        let expected = ctx.world().all_reduce(x.clone(), ReduceOp::Sum)?;
        assert_bits_eq(
            &reduced.inner().into_data(),
            &expected.clone().into_data(),
            "autodiff",
        );
        // Calls issued together complete in order, off the caller's thread.
        let works: Vec<_> = (0..4)
            .map(|k| nccl.all_reduce_async(x.clone().mul_scalar(k as f32), ReduceOp::Sum))
            .collect();
        for (k, work) in works.into_iter().enumerate() {
            same(work.wait()?, expected.clone().mul_scalar(k as f32), "async");
        }
        Ok(())
    });
}

#[test]
fn fusion_tensors_work() {
    use burn_cubecl::CubeBackend;
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    /// burn's `Cuda` as a build with burn's `fusion` feature names it.
    type F = burn_fusion::Fusion<CubeBackend<CudaRuntime, f32, i32, u8>>;
    on_nccl(2, MINUTE, |ctx, nccl| {
        let (rank, local) = (ctx.rank(), ctx.world());
        let x = whole::<2>(rank as u64, [4, 6]);
        // Fused work still queued for the input runs before NCCL reads it, and the result
        // feeds more fused work.
        let fused = Tensor::<F, 2>::from_data(x.to_data(), &device())
            .mul_scalar(2.0)
            .add_scalar(1.0);
        let reduced = nccl
            .all_reduce(fused.clone(), ReduceOp::Sum)?
            .mul_scalar(0.5);
        let expected = local
            .all_reduce(x.clone().mul_scalar(2.0).add_scalar(1.0), ReduceOp::Sum)?
            .mul_scalar(0.5);
        assert_bits_eq(
            &reduced.into_data(),
            &expected.into_data(),
            "fused all_reduce",
        );
        assert_bits_eq(
            &nccl.all_gather(fused.clone(), 1)?.into_data(),
            &local
                .all_gather(x.clone().mul_scalar(2.0).add_scalar(1.0), 1)?
                .into_data(),
            "fused all_gather",
        );
        let ints = Tensor::<F, 1, Int>::arange(0..12, &device()).mul_scalar(rank as i64 + 1);
        let local_ints = Tensor::<G, 1, Int>::arange(0..12, &device()).mul_scalar(rank as i64 + 1);
        assert_bits_eq(
            &nccl.all_reduce(ints.clone(), ReduceOp::Sum)?.into_data(),
            &local
                .all_reduce(local_ints.clone(), ReduceOp::Sum)?
                .into_data(),
            "fused ints",
        );
        assert_bits_eq(
            &nccl.broadcast(ints.greater_elem(5), 1)?.into_data(),
            &local.broadcast(local_ints.greater_elem(5), 1)?.into_data(),
            "fused bools",
        );
        let tracked = Tensor::<Autodiff<F>, 2>::from_inner(fused).require_grad();
        assert_bits_eq(
            &nccl.all_gather(tracked, 0)?.inner().into_data(),
            &local
                .all_gather(x.mul_scalar(2.0).add_scalar(1.0), 0)?
                .into_data(),
            "autodiff over fusion",
        );
        Ok(())
    });
}

#[test]
fn collective_matmuls_overlap_on_the_nccl_stream() {
    use burn_comm::parallel::{RegionOp, region_matmul};
    type A = Autodiff<G>;
    let ops = [
        RegionOp::Copy,
        RegionOp::Reduce,
        RegionOp::SequenceGather { dim: 1 },
        RegionOp::SequenceReduceScatter { dim: 1 },
    ];
    on_nccl(2, MINUTE, |ctx, nccl| {
        let seed = 10 * ctx.rank() as u64;
        for op in ops {
            // Whole numbers: every product and sum is exact, so both transports agree bit for bit.
            let run = |comm: &Communicator| -> Result<_, CommError> {
                let x = Tensor::<A, 3>::from_inner(whole(seed, [2, 6, 4])).require_grad();
                let w = Tensor::<A, 2>::from_inner(whole(seed + 1, [4, 3])).require_grad();
                let y = region_matmul(x.clone(), w.clone(), comm, op, 2)?;
                let probe = Tensor::<A, 3>::from_inner(whole(seed + 2, y.dims()));
                let grads = (y.clone() * probe).sum().backward();
                Ok((
                    y.inner().into_data(),
                    x.grad(&grads).unwrap().into_data(),
                    w.grad(&grads).unwrap().into_data(),
                ))
            };
            let (on_nccl, local) = (run(nccl)?, run(ctx.world())?);
            assert_bits_eq(&on_nccl.0, &local.0, &format!("{op:?} output"));
            assert_bits_eq(&on_nccl.1, &local.1, &format!("{op:?} input grad"));
            assert_bits_eq(&on_nccl.2, &local.2, &format!("{op:?} weight grad"));
        }
        Ok(())
    });
}

#[test]
fn a_mesh_splits_on_nccl() {
    on_nccl(2, MINUTE, |ctx, nccl| {
        let mesh = burn_comm::DeviceMesh::new(nccl, &[("dp", 1), ("tp", 2)])?;
        let tp = mesh.group("tp")?;
        let dp = mesh.group("dp")?;
        assert!(tp.is_nccl() && dp.is_nccl());
        assert!(
            tp.host().is_none(),
            "a split of a group on NCCL has no host twin"
        );
        assert_eq!((tp.size(), dp.size()), (2, 1));
        let x = whole::<1>(ctx.rank() as u64, [5]);
        same(
            tp.all_gather(x.clone(), 0)?,
            ctx.world().all_gather(x.clone(), 0)?,
            "all_gather on the split group",
        );
        same(
            dp.all_reduce(x.clone(), ReduceOp::Sum)?,
            x,
            "a group of one",
        );
        Ok(())
    });
}

#[test]
fn bad_calls_fail_clearly() {
    on_nccl(2, MINUTE, |ctx, nccl| {
        // Host tensors cannot go through NCCL.
        let host = Tensor::<Flex, 1>::ones([4], &Default::default());
        let error = nccl
            .all_reduce(host, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(error.contains("CUDA backend"), "{error}");
        let host = Tensor::<Flex, 1>::ones([4], &Default::default());
        let error = nccl.send(host, 1 - ctx.rank()).unwrap_err().to_string();
        assert!(error.contains("CUDA backend"), "{error}");
        Ok(())
    });
}

#[test]
fn sends_are_buffered_and_ordered_on_nccl() {
    on_nccl(2, MINUTE, |ctx, nccl| {
        let (rank, peer) = (ctx.rank(), 1 - ctx.rank());
        // 20 MB, far past NCCL's eager buffer (4 MiB): a send that waited for its receive
        // would wait here for ever.
        let big = |rank: usize| whole::<2>(rank as u64 + 100, [1250, 4096]);
        let floats = |rank: usize| whole::<2>(rank as u64, [3, 5]);
        let ints =
            |rank: usize| Tensor::<G, 1, Int>::arange(0..7, &device()).mul_scalar(rank as i64 + 2);
        // Both ranks send everything before either receives, as a pipeline's steady state
        // does.
        nccl.send(big(rank), peer)?;
        nccl.send(floats(rank), peer)?;
        nccl.send(ints(rank), peer)?;
        nccl.send(ints(rank).greater_elem(6), peer)?;
        nccl.send(Tensor::<G, 2>::zeros([0, 4], &device()), peer)?;
        let tracked = Tensor::<Autodiff<G>, 2>::from_inner(floats(rank).mul_scalar(3.0));
        let sent = nccl.send_async(tracked.require_grad(), peer);
        same(nccl.recv(peer, [1250, 4096], &device())?, big(peer), "big");
        same(nccl.recv(peer, [3, 5], &device())?, floats(peer), "floats");
        same(nccl.recv(peer, [7], &device())?, ints(peer), "ints");
        same(
            nccl.recv(peer, [7], &device())?,
            ints(peer).greater_elem(6),
            "bools",
        );
        let empty: Tensor<G, 2> = nccl.recv(peer, [0, 4], &device())?;
        assert_eq!(empty.dims(), [0, 4]);
        let tracked: Tensor<Autodiff<G>, 2> = nccl.recv_async(peer, [3, 5], &device()).wait()?;
        same(tracked.inner(), floats(peer).mul_scalar(3.0), "autodiff");
        sent.wait()?;
        // A group split off the world has pairs of its own.
        let mesh = burn_comm::DeviceMesh::new(nccl, &[("dp", 1), ("pp", 2)])?;
        let pp = mesh.group("pp")?;
        for round in 0..3 {
            pp.send(floats(rank).add_scalar(round as f32), peer)?;
        }
        for round in 0..3 {
            let got: Tensor<G, 2> = pp.recv(peer, [3, 5], &device())?;
            same(got, floats(peer).add_scalar(round as f32), "split group");
        }
        Ok(())
    });
}

#[test]
fn a_receive_of_another_shape_is_refused_and_consumes_the_message() {
    on_nccl(2, MINUTE, |ctx, nccl| {
        let (x, y) = (whole::<1>(1, [4]), whole::<1>(2, [3]));
        if ctx.rank() == 0 {
            nccl.send(x, 1)?;
            nccl.send(y, 1)?;
            return Ok(());
        }
        // A host tensor is refused before anything is received.
        let host = nccl.recv::<Flex, 1, burn::tensor::Float>(0, [4], &Default::default());
        let error = host.unwrap_err().to_string();
        assert!(error.contains("CUDA backend"), "{error}");
        let refused = nccl.recv::<G, 1, burn::tensor::Float>(0, [5], &device());
        assert!(
            matches!(&refused, Err(CommError::Mismatch { theirs, .. }) if theirs == "send of F32 [4]"),
            "{refused:?}"
        );
        // As on the local transport, the refused message is gone and the next one follows.
        same(nccl.recv(0, [3], &device())?, y, "the next message");
        Ok(())
    });
}

#[test]
fn a_missing_peer_times_out_and_breaks_the_group() {
    let results = on_nccl(2, Duration::from_secs(3), |ctx, nccl| {
        // Both make one call first: NCCL connects the ranks on an algorithm's first use, and
        // that blocking connect is not under the watchdog.
        let x = Tensor::<G, 1>::ones([4], &device());
        nccl.all_reduce(x.clone(), ReduceOp::Sum)?;
        if ctx.rank() == 1 {
            return Ok(None);
        }
        let first = nccl.all_reduce(x.clone(), ReduceOp::Sum).unwrap_err();
        let later = nccl.all_reduce(x, ReduceOp::Sum).unwrap_err();
        Ok(Some((first, later)))
    });
    if let Some(results) = results {
        let (first, later) = results[0].clone().expect("rank 0 waited");
        assert!(
            matches!(&first, CommError::Transport { reason, .. } if reason.contains("did not finish within")),
            "{first}"
        );
        assert!(matches!(later, CommError::GroupBroken { .. }), "{later}");
    }
}
