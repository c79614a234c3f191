//! Context parallelism against the oracle: `tiny` (4 query heads over 2 key/value heads)
//! trained 20 steps on one device and with every sequence split over 2 and 4 context-parallel
//! ranks (load-balanced chunks, ring attention and all-gather attention), and composed with
//! data, tensor (with sequence parallelism) and pipeline parallelism and with ZeRO.
//!
//! Tolerances are in `common`: a rank's loss is the mean over its tokens and the gradients
//! are averaged over the context-parallel ranks, and attention merges partial softmaxes, each
//! a different order of sums from one device's.

mod common;

use burn_tensor_parallel::CpAttention;
use burn_zero::ZeroStage;
use common::*;
use llama::train::{Strategy, TrainConfig};

fn context_parallel(dp: usize, cp: usize) -> TrainConfig {
    let mut config = config(Strategy::Ddp, dp);
    config.cp = cp;
    config
}

#[test]
fn context_parallel_matches_one_device_at_cp_2_and_4() {
    let oracle = run(&config(Strategy::Single, 1));
    assert_close(&oracle, &run(&context_parallel(1, 2)), "cp 2");
    assert_close(&oracle, &run(&context_parallel(1, 4)), "cp 4");
    let mut gathered = context_parallel(1, 2);
    gathered.cp_attention = CpAttention::AllGather;
    assert_close(&oracle, &run(&gathered), "cp 2, all-gather attention");
}

#[test]
fn context_parallel_composes_with_data_tensor_and_pipeline_parallelism() {
    let oracle = run(&config(Strategy::Single, 1));
    assert_close(&oracle, &run(&context_parallel(2, 2)), "dp 2 x cp 2");
    let mut tp = context_parallel(1, 2);
    tp.tp = 2;
    tp.sequence_parallel = true;
    assert_close(&oracle, &run(&tp), "cp 2 x tp 2 + sp");
    let mut pp = context_parallel(1, 2);
    pp.pp = 2;
    pp.grad_accum = Some(4);
    let mut oracle_accum = config(Strategy::Single, 1);
    oracle_accum.grad_accum = Some(4);
    let oracle_accum = run(&oracle_accum);
    assert_close(&oracle_accum, &run(&pp), "pp 2 x cp 2");
    // Zero-bubble's weight half runs again what the ring's backward needs.
    pp.schedule = burn_pipeline::ScheduleKind::ZeroBubbleH1;
    assert_close(&oracle_accum, &run(&pp), "pp 2 x cp 2, zb-h1");
}

#[test]
fn context_parallel_composes_with_zero() {
    let oracle = run(&config(Strategy::Single, 1));
    for stage in [ZeroStage::OptimizerState, ZeroStage::Parameters] {
        let mut sharded = context_parallel(1, 2);
        sharded.zero = stage;
        assert_close(
            &oracle,
            &run(&sharded),
            &format!("cp 2, ZeRO-{}", stage.number()),
        );
    }
}
