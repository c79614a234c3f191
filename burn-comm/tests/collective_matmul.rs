//! The collective matmul against the region op and the matmul one after the other, forward and
//! backward, at world sizes 1 to 4 and with chunk counts that cut the rows evenly and unevenly.

mod common;

use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor, TensorData, Tolerance};
use burn_comm::parallel::{self, CommBackend, RegionOp, matmul};
use burn_comm::{CommError, Communicator};
use common::*;

type AD = Autodiff<B>;

const BOTH: [bool; 2] = [true, true];

const FUSED: [RegionOp; 4] = [
    RegionOp::Copy,
    RegionOp::Reduce,
    RegionOp::SequenceGather { dim: 1 },
    RegionOp::SequenceReduceScatter { dim: 1 },
];

/// The region op and the matmul one after the other: what the fused op must equal.
fn unfused<Be: CommBackend, const D: usize>(
    x: Tensor<Be, D>,
    w: Tensor<Be, 2>,
    comm: &Communicator,
    op: RegionOp,
) -> Result<Tensor<Be, D>, CommError> {
    match op {
        RegionOp::Copy | RegionOp::SequenceGather { .. } => {
            Ok(matmul(Be::region_op(x, comm, op)?, w))
        }
        _ => Be::region_op(matmul(x, w), comm, op),
    }
}

/// The output, and the gradients of `x` and `w` (those tracked), for the loss `sum(y * probe)`.
type Outcome = (TensorData, Option<TensorData>, Option<TensorData>);

/// Runs `y = op` fused with `x @ w` (`chunks` > 0) or unfused (`chunks` = 0) and differentiates;
/// `track` says which of `x` and `w` need a gradient.
fn outcome(
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
    seed: u64,
    track: [bool; 2],
) -> Result<Outcome, CommError> {
    // Copy communicates only backward. Without a collective between two backward passes, one
    // rank's backward could wait on its peer while the peer, done with its previous backward,
    // is stuck in burn-autodiff 0.21's clean-up, which locks every graph of the process.
    comm.barrier()?;
    let (world, rank) = (comm.size(), comm.rank());
    // 5 rows per rank along the sequence, so 2 and 3 chunks cut it unevenly.
    let seq = match op {
        RegionOp::SequenceReduceScatter { .. } => 5 * world,
        _ => 5,
    };
    let seed = seed + 100 * rank as u64;
    let x = Tensor::<AD, 3>::from_inner(random(seed, [2, seq, 6], DType::F32));
    let w = Tensor::<AD, 2>::from_inner(random(seed + 1, [6, 4], DType::F32));
    let x = if track[0] { x.require_grad() } else { x };
    let w = if track[1] { w.require_grad() } else { w };
    let y = if chunks > 0 {
        parallel::region_matmul(x.clone(), w.clone(), comm, op, chunks)?
    } else {
        unfused(x.clone(), w.clone(), comm, op)?
    };
    let probe = Tensor::<AD, 3>::from_inner(random(seed + 2, y.dims(), DType::F32));
    let grads = (y.clone() * probe).sum().backward();
    Ok((
        y.into_data(),
        x.grad(&grads).map(|g| g.into_data()),
        w.grad(&grads).map(|g| g.into_data()),
    ))
}

fn assert_same(actual: &Outcome, expected: &Outcome) {
    assert_close(&actual.0, &expected.0);
    for (actual, expected) in [(&actual.1, &expected.1), (&actual.2, &expected.2)] {
        match (actual, expected) {
            (Some(actual), Some(expected)) => assert_close(actual, expected),
            (None, None) => {}
            _ => panic!("a gradient on one side only"),
        }
    }
}

fn assert_close(actual: &TensorData, expected: &TensorData) {
    actual.assert_approx_eq::<f32>(expected, Tolerance::rel_abs(1e-5, 1e-6));
}

#[test]
fn the_fused_op_matches_the_region_op_then_the_matmul() {
    for world in 1..=4 {
        for op in FUSED {
            let results = run(world, |ctx| {
                let comm = ctx.world();
                let unfused = outcome(comm, op, 0, 7, BOTH)?;
                let fused = [1, 2, 3, 8]
                    .map(|chunks| outcome(comm, op, chunks, 7, BOTH))
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((unfused, fused))
            });
            for (unfused, fused) in results {
                for fused in fused {
                    assert!(fused.1.is_some() && fused.2.is_some());
                    assert_same(&fused, &unfused);
                }
            }
        }
    }
}

#[test]
fn a_frozen_input_or_weight_leaves_the_other_gradient_as_it_was() {
    let results = run(3, |ctx| {
        let mut pairs = Vec::new();
        for op in FUSED {
            for track in [[true, false], [false, true]] {
                let fused = outcome(ctx.world(), op, 2, 5, track)?;
                let unfused = outcome(ctx.world(), op, 0, 5, track)?;
                assert_eq!((fused.1.is_some(), fused.2.is_some()), (track[0], track[1]));
                pairs.push((fused, unfused));
            }
        }
        Ok(pairs)
    });
    for (fused, unfused) in results.into_iter().flatten() {
        assert_same(&fused, &unfused);
    }
}

#[test]
fn a_two_dimensional_input_splits_its_rows() {
    // [seq, features], the sequence along dim 0.
    let results = run(2, |ctx| {
        let comm = ctx.world();
        let w = random::<2>(4, [6, 3], DType::F32);
        let mut pairs = Vec::new();
        for (op, rows) in [
            (RegionOp::SequenceGather { dim: 0 }, 5),
            (RegionOp::SequenceReduceScatter { dim: 0 }, 10),
        ] {
            let x = random::<2>(5 + ctx.rank() as u64, [rows, 6], DType::F32);
            let fused = parallel::region_matmul(x.clone(), w.clone(), comm, op, 2)?;
            let unfused = unfused(x, w.clone(), comm, op)?;
            pairs.push((fused.into_data(), unfused.into_data()));
        }
        Ok(pairs)
    });
    for (fused, unfused) in results.into_iter().flatten() {
        assert_close(&fused, &unfused);
    }
}

#[test]
fn each_chunk_is_its_own_collective() {
    // Forward and backward, 3 chunks: the fused direction issues one call per chunk.
    let results = run(2, |ctx| {
        let comm = ctx.world();
        let mut calls = Vec::new();
        for op in FUSED {
            comm.reset_stats();
            outcome(comm, op, 3, 1, BOTH)?;
            let stats = comm.stats();
            calls.push((
                stats.all_reduce.calls,
                stats.all_gather.calls,
                stats.reduce_scatter.calls,
            ));
        }
        Ok(calls)
    });
    for calls in results {
        // (all-reduce, all-gather, reduce-scatter) for copy, reduce, gather, reduce-scatter.
        assert_eq!(calls, [(3, 0, 0), (3, 0, 0), (0, 3, 3), (0, 3, 3)]);
    }
}

#[test]
fn without_autodiff_the_forward_matches() {
    let results = run(2, |ctx| {
        let comm = ctx.world();
        let x = random::<3>(3 + ctx.rank() as u64, [2, 4, 6], DType::F32);
        let w = random::<2>(9, [6, 4], DType::F32);
        let mut pairs = Vec::new();
        for op in FUSED {
            let fused = parallel::region_matmul(x.clone(), w.clone(), comm, op, 3)?;
            let unfused = unfused(x.clone(), w.clone(), comm, op)?;
            pairs.push((fused.into_data(), unfused.into_data()));
        }
        Ok(pairs)
    });
    for (fused, unfused) in results.into_iter().flatten() {
        assert_close(&fused, &unfused);
    }
}

#[test]
fn bad_input_is_refused_on_every_rank() {
    let results = run(2, |ctx| {
        let comm = ctx.world();
        let x = || Tensor::<AD, 3>::from_inner(random(1, [2, 3, 6], DType::F32));
        let w = |rows| Tensor::<AD, 2>::from_inner(random(2, [rows, 4], DType::F32));
        let errors = [
            parallel::region_matmul(x(), w(6), comm, RegionOp::Scatter { dim: 1 }, 2),
            parallel::region_matmul(x(), w(5), comm, RegionOp::Reduce, 2),
            parallel::region_matmul(x(), w(6), comm, RegionOp::SequenceGather { dim: 2 }, 2),
            // 3 rows do not split over 2 ranks.
            parallel::region_matmul(
                x(),
                w(6),
                comm,
                RegionOp::SequenceReduceScatter { dim: 1 },
                2,
            ),
        ];
        Ok(errors.map(|e| e.expect_err("refused").to_string()))
    });
    for errors in results {
        assert!(errors[0].contains("fuse with a matmul"), "{}", errors[0]);
        assert!(errors[1].contains("cannot be multiplied"), "{}", errors[1]);
        assert!(errors[2].contains("not a row dimension"), "{}", errors[2]);
        assert!(errors[3].contains("does not divide"), "{}", errors[3]);
    }
}
