//! Faults never hang: a rank that panics, returns an error, returns early or never arrives,
//! and ranks that disagree on a call, each give every rank an error within the timeout.

mod common;

use std::time::{Duration, Instant};

use burn::tensor::{DType, Float, Tensor};
use burn_comm::{CommError, LaunchConfig, RankError, ReduceOp, launch_with};
use common::*;

const TIMEOUT: Duration = Duration::from_millis(500);

/// Launches with a short timeout and checks that the whole launch ends well within it.
fn launch_bounded<T: Send>(
    world: usize,
    f: impl Fn(burn_comm::RankContext) -> Result<T, CommError> + Sync,
) -> Vec<Result<T, RankError<CommError>>> {
    let start = Instant::now();
    let results = launch_with(LaunchConfig::new(world).with_timeout(TIMEOUT), f);
    let elapsed = start.elapsed();
    assert!(elapsed < TIMEOUT * 6, "the launch took {elapsed:?}");
    results
}

fn comm_error<T: std::fmt::Debug>(result: &Result<T, RankError<CommError>>) -> &CommError {
    match result {
        Err(RankError::Failed { error, .. }) => error,
        other => panic!("expected a communication error, got {other:?}"),
    }
}

fn x(ctx_rank: usize, len: usize) -> Tensor<B, 1> {
    random(ctx_rank as u64, [len], DType::F32)
}

#[test]
fn a_panicking_rank_fails_every_peer_blocked_on_it() {
    for world in [2, 4] {
        let start = Instant::now();
        // A long timeout: the peers must learn of the panic, not wait it out.
        let results = launch_with(
            LaunchConfig::new(world).with_timeout(Duration::from_secs(60)),
            |ctx| {
                if ctx.rank() == 1 {
                    panic!("boom on purpose");
                }
                ctx.world()
                    .all_reduce(x(ctx.rank(), 8), ReduceOp::Sum)
                    .map(|_| ())
            },
        );
        assert!(start.elapsed() < Duration::from_secs(10));
        for (rank, result) in results.iter().enumerate() {
            if rank == 1 {
                assert!(
                    matches!(result, Err(RankError::Panicked { rank: 1, message }) if message == "boom on purpose")
                );
            } else {
                let error = comm_error(result);
                assert!(
                    matches!(error, CommError::PeerFailed { rank: 1, .. }),
                    "{error}"
                );
                assert!(
                    error.to_string().contains("panicked: boom on purpose"),
                    "{error}"
                );
            }
        }
    }
}

#[test]
fn a_rank_returning_an_error_fails_its_peers() {
    let results = launch_bounded(3, |ctx| {
        if ctx.rank() == 2 {
            return Err(CommError::Config("bad input on purpose".into()));
        }
        ctx.world().barrier()
    });
    for result in &results[..2] {
        let error = comm_error(result);
        assert!(
            matches!(error, CommError::PeerFailed { rank: 2, .. }),
            "{error}"
        );
        assert!(
            error.to_string().contains("bad input on purpose"),
            "{error}"
        );
    }
}

#[test]
fn a_rank_returning_early_fails_its_peers() {
    let results = launch_bounded(2, |ctx| {
        if ctx.rank() == 0 {
            return Ok(());
        }
        ctx.world().all_gather(x(1, 4), 0).map(|_| ())
    });
    assert!(results[0].is_ok());
    let error = comm_error(&results[1]);
    assert!(
        matches!(error, CommError::PeerFailed { rank: 0, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("without joining"), "{error}");
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let start = Instant::now();
    let results = launch_bounded(3, |ctx| {
        if ctx.rank() == 2 {
            // Arrives long after its peers gave up.
            std::thread::sleep(TIMEOUT * 3);
        }
        ctx.world()
            .all_reduce(x(ctx.rank(), 4), ReduceOp::Sum)
            .map(|_| ())
    });
    assert!(start.elapsed() >= TIMEOUT);
    for result in &results[..2] {
        let error = comm_error(result);
        match error {
            CommError::Timeout {
                missing, group, op, ..
            } => {
                assert_eq!(missing, &vec![2]);
                assert_eq!(group, "world");
                assert!(op.starts_with("all_reduce(sum)"), "{op}");
            }
            other => panic!("expected a timeout, got {other}"),
        }
    }
    // The late rank finds the group broken by the timeout, with the cause.
    let error = comm_error(&results[2]);
    assert!(matches!(error, CommError::GroupBroken { .. }), "{error}");
    assert!(error.to_string().contains("never joined"), "{error}");
}

#[test]
fn a_shape_mismatch_names_both_calls_on_every_rank() {
    let results = launch_bounded(2, |ctx| {
        let len = if ctx.rank() == 1 { 5 } else { 4 };
        ctx.world()
            .all_reduce(x(ctx.rank(), len), ReduceOp::Sum)
            .map(|_| ())
    });
    for result in &results {
        let error = comm_error(result).to_string();
        assert!(
            error.contains("all_reduce(sum) on F32 [4]")
                && error.contains("all_reduce(sum) on F32 [5]"),
            "{error}"
        );
    }
}

#[test]
fn an_op_mismatch_names_both_calls_on_every_rank() {
    let results = launch_bounded(3, |ctx| {
        let comm = ctx.world();
        if ctx.rank() == 2 {
            comm.all_gather(x(ctx.rank(), 4), 0).map(|_| ())
        } else {
            comm.all_reduce(x(ctx.rank(), 4), ReduceOp::Max).map(|_| ())
        }
    });
    for result in &results {
        let error = comm_error(result);
        assert!(matches!(error, CommError::Mismatch { .. }), "{error}");
        let text = error.to_string();
        assert!(
            text.contains("all_reduce(max)") && text.contains("all_gather(dim 0)"),
            "{text}"
        );
    }
}

#[test]
fn a_dtype_mismatch_names_both_calls() {
    let results = launch_bounded(2, |ctx| {
        let dtype = if ctx.rank() == 0 {
            DType::F32
        } else {
            DType::F16
        };
        ctx.world()
            .broadcast(random::<1>(0, [3], dtype), 0)
            .map(|_| ())
    });
    for result in &results {
        let text = comm_error(result).to_string();
        assert!(text.contains("F32") && text.contains("F16"), "{text}");
    }
}

#[test]
fn after_a_failure_the_group_refuses_further_calls() {
    let results = launch_bounded(2, |ctx| {
        let len = 3 + ctx.rank();
        let first = ctx
            .world()
            .all_reduce(x(ctx.rank(), len), ReduceOp::Sum)
            .map(|_| ());
        assert!(first.is_err());
        ctx.world().barrier()
    });
    for result in &results {
        assert!(matches!(comm_error(result), CommError::GroupBroken { .. }));
    }
}

#[test]
fn bad_arguments_are_refused_on_the_calling_rank() {
    let results = launch_bounded(2, |ctx| {
        let comm = ctx.world();
        let uneven = comm.reduce_scatter(x(0, 5), ReduceOp::Sum, 0).unwrap_err();
        let dim = comm.all_gather(x(0, 4), 1).unwrap_err();
        let root = comm.broadcast(x(0, 4), 2).unwrap_err();
        let bool_sum = comm
            .all_reduce(x(0, 4).greater_elem(0.0), ReduceOp::Sum)
            .unwrap_err();
        let avg_int = comm.all_reduce(x(0, 4).int(), ReduceOp::Avg).unwrap_err();
        let self_send = comm.send(x(0, 4), ctx.rank()).unwrap_err();
        // The group still works: nothing was posted.
        comm.barrier()?;
        Ok([uneven, dim, root, bool_sum, avg_int, self_send].map(|e| e.to_string()))
    });
    let [uneven, dim, root, bool_sum, avg_int, self_send] = results[0].as_ref().unwrap().clone();
    assert!(
        uneven.contains("size 5 along dim 0 does not divide by the group size 2; pad it to 6"),
        "{uneven}"
    );
    assert!(
        dim.contains("dim 1 is out of range for a 1-d tensor"),
        "{dim}"
    );
    assert!(
        root.contains("rank 2 is not in this group of 2 ranks"),
        "{root}"
    );
    assert!(bool_sum.contains("cannot be reduced"), "{bool_sum}");
    assert!(
        avg_int.contains("avg needs a floating-point tensor"),
        "{avg_int}"
    );
    assert!(self_send.contains("must be another rank"), "{self_send}");
}

#[test]
fn recv_from_a_silent_peer_times_out_and_a_wrong_shape_is_named() {
    let results = launch_bounded(2, |ctx| {
        let comm = ctx.world();
        if ctx.rank() == 0 {
            comm.send(x(0, 6), 1)?;
            // Stay alive past rank 1's timeout without sending again.
            std::thread::sleep(TIMEOUT * 2);
            Ok(String::new())
        } else {
            let wrong = comm
                .recv::<B, 1, Float>(0, [4], &Default::default())
                .unwrap_err();
            let silent = comm
                .recv::<B, 1, Float>(0, [6], &Default::default())
                .unwrap_err();
            Ok(format!("{wrong}\n{silent}"))
        }
    });
    let text = results[1].as_ref().unwrap();
    assert!(
        text.contains("recv(from 0) of F32 [4]") && text.contains("send of F32 [6]"),
        "{text}"
    );
    assert!(text.contains("never joined"), "{text}");
}

#[test]
fn arguments_refused_on_one_rank_only_fail_every_rank() {
    // Rank 1's shape does not divide by the group size; rank 0's does: a mismatch on both,
    // not a rank left waiting for a peer that refused the call.
    let results = launch_bounded(2, |ctx| {
        let len = if ctx.rank() == 0 { 4 } else { 3 };
        ctx.world()
            .reduce_scatter(x(ctx.rank(), len), ReduceOp::Sum, 0)
            .map(|_| ())
    });
    for result in &results {
        let error = comm_error(result);
        assert!(matches!(error, CommError::Mismatch { .. }), "{error}");
    }
}

#[test]
fn a_send_left_in_flight_is_delivered_after_its_rank_returns() {
    let results = launch_bounded(2, |ctx| {
        let comm = ctx.world();
        if ctx.rank() == 0 {
            // Fire and forget, then return at once.
            let _ = comm.send_async(x(0, 16), 1);
            return Ok(0.0);
        }
        std::thread::sleep(Duration::from_millis(50));
        let got: Tensor<B, 1> = comm.recv(0, [16], &Default::default())?;
        Ok(got.sum().into_scalar())
    });
    let expected = x(0, 16).sum().into_scalar();
    assert_eq!(*results[1].as_ref().unwrap(), expected);
}

#[test]
fn an_unrepresentably_long_timeout_means_no_timeout() {
    let results = launch_with(LaunchConfig::new(2).with_timeout(Duration::MAX), |ctx| {
        ctx.world()
            .all_reduce(x(ctx.rank(), 4), ReduceOp::Sum)
            .map(|_| ())
    });
    assert!(results.iter().all(Result::is_ok));
}
