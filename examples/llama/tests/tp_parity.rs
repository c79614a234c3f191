//! Tensor parallelism against the oracle: `tiny` (4 query heads, 2 key/value heads) trained 20
//! steps on one device and split over 2 and 4 tensor-parallel ranks (at 4 the key/value heads
//! are shared by pairs of ranks), with sequence parallelism, and on a 2 x 2 data x tensor
//! mesh, and with the communication overlapped by collective matmuls, and with the head tied to
//! the vocab-parallel embedding (also under ZeRO-3). The final weights are gathered from the
//! shards.
//!
//! Tolerances are in `common`: row-parallel layers sum partial matmuls across ranks, a
//! different order from one device's single matmul.

mod common;

use common::*;
use llama::train::Strategy;

fn tensor_parallel(dp: usize, tp: usize, sequence_parallel: bool) -> Run {
    overlapped(dp, tp, sequence_parallel, 0)
}

fn overlapped(dp: usize, tp: usize, sequence_parallel: bool, chunks: usize) -> Run {
    let strategy = if dp == 1 {
        Strategy::Single
    } else {
        Strategy::Ddp
    };
    let mut config = config(strategy, dp);
    config.tp = tp;
    config.sequence_parallel = sequence_parallel;
    config.tp_overlap = chunks;
    run(&config)
}

#[test]
fn tensor_parallel_matches_one_device_at_tp_2_and_4() {
    let oracle = run(&config(Strategy::Single, 1));
    assert!(
        oracle.losses[19] < oracle.losses[0] - 0.5,
        "{:?}",
        oracle.losses
    );
    assert_close(&oracle, &tensor_parallel(1, 2, false), "tp 2");
    assert_close(&oracle, &tensor_parallel(1, 4, false), "tp 4");
}

#[test]
fn sequence_parallel_matches_one_device() {
    let oracle = run(&config(Strategy::Single, 1));
    assert_close(&oracle, &tensor_parallel(1, 2, true), "tp 2 + sp");
    assert_close(&oracle, &tensor_parallel(1, 4, true), "tp 4 + sp");
}

#[test]
fn data_times_tensor_parallel_matches_one_device() {
    let oracle = run(&config(Strategy::Single, 1));
    assert_close(&oracle, &tensor_parallel(2, 2, false), "dp 2 x tp 2");
    assert_close(&oracle, &tensor_parallel(2, 2, true), "dp 2 x tp 2 + sp");
}

#[test]
fn overlapped_communication_matches_one_device() {
    let oracle = run(&config(Strategy::Single, 1));
    assert_close(&oracle, &overlapped(1, 2, false, 2), "tp 2, 2 chunks");
    assert_close(&oracle, &overlapped(1, 4, true, 3), "tp 4 + sp, 3 chunks");
    assert_close(
        &oracle,
        &overlapped(2, 2, true, 1),
        "dp 2 x tp 2 + sp, 1 chunk",
    );
}

#[test]
fn a_tied_head_matches_one_device_under_tensor_parallelism() {
    // The head's columns are the vocab-parallel embedding's rows on every rank.
    let mut base = config(Strategy::Single, 1);
    base.model.tie_word_embeddings = true;
    let oracle = run(&base);
    let tied = |dp: usize, tp: usize, sp: bool, chunks: usize| {
        let mut config = base.clone();
        config.strategy = if dp == 1 {
            Strategy::Single
        } else {
            Strategy::Ddp
        };
        config.dp = dp;
        config.tp = tp;
        config.sequence_parallel = sp;
        config.tp_overlap = chunks;
        run(&config)
    };
    assert_close(&oracle, &tied(1, 2, false, 0), "tied, tp 2");
    assert_close(&oracle, &tied(1, 4, true, 2), "tied, tp 4 + sp, 2 chunks");
    assert_close(&oracle, &tied(2, 2, true, 0), "tied, dp 2 x tp 2 + sp");
    // ZeRO-3 shards each unit's tp slices over dp: the last unit reads the first's rows.
    let mut sharded = zero(&base, 2, STAGES[2]);
    sharded.tp = 2;
    assert_close(&oracle, &run(&sharded), "tied, dp 2 x tp 2, ZeRO-3");
}
