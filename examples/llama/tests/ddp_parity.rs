//! Data parallelism against the oracle: `tiny` trained 20 steps on one device and under DDP
//! (1, 2 and 4 ranks), DDP with gradient accumulation and the parameter-server baseline, all on
//! the same global batches from the same seed; and a head tied to the embedding under DDP and
//! ZeRO-1/2/3 (under pp: pp_parity.rs).
//!
//! Tolerances are in `common` (measured here: losses ~1e-7, weights ~3e-6 relative).

mod common;

use common::*;
use llama::train::Strategy;

#[test]
fn ddp_matches_one_device_at_1_2_and_4_ranks() {
    let oracle = run(&config(Strategy::Single, 1));
    // Training must actually move, or parity would prove nothing.
    assert!(
        oracle.losses[19] < oracle.losses[0] - 0.5,
        "{:?}",
        oracle.losses
    );
    for dp in [1, 2, 4] {
        let ddp = run(&config(Strategy::Ddp, dp));
        assert_close(&oracle, &ddp, &format!("DDP with {dp} ranks"));
    }
}

#[test]
fn ddp_matches_one_device_across_epochs_of_an_uneven_dataset() {
    // 45 samples: 5 global batches of 8 per epoch, the tail dropped alike by every layout.
    let oracle = run_on(&config(Strategy::Single, 1), 45);
    assert_close(
        &oracle,
        &run_on(&config(Strategy::Ddp, 4), 45),
        "DDP, 4 epochs",
    );
}

#[test]
fn ddp_with_gradient_accumulation_matches_ddp_without() {
    let plain = run(&config(Strategy::Ddp, 2));
    let mut accumulated = config(Strategy::Ddp, 2);
    accumulated.grad_accum = Some(2);
    assert_close(
        &plain,
        &run(&accumulated),
        "DDP with 2 micro-batches per rank",
    );
}

#[test]
fn small_buckets_and_no_overlap_give_the_same_run() {
    let plain = run(&config(Strategy::Ddp, 2));
    let mut small = config(Strategy::Ddp, 2);
    small.ddp = small.ddp.with_bucket_cap_bytes(64 * 1024);
    let small = run(&small);
    let mut serial = config(Strategy::Ddp, 2);
    serial.ddp = serial.ddp.with_overlap(false);
    let serial = run(&serial);
    // Bucketing changes nothing but timing: the sums are the same, so the bits are too.
    assert_eq!(plain.losses, small.losses);
    assert_eq!(plain.losses, serial.losses);
}

#[test]
fn parameter_server_matches_ddp() {
    let ddp = run(&config(Strategy::Ddp, 2));
    let ps = run(&config(Strategy::ParameterServer, 2));
    assert_close(&ddp, &ps, "parameter server with 2 ranks");
}

#[test]
fn a_tied_head_matches_one_device_under_ddp_and_zero() {
    let mut base = config(Strategy::Single, 1);
    base.model.tie_word_embeddings = true;
    let oracle = run(&base);
    assert!(
        oracle.losses[19] < oracle.losses[0] - 0.5,
        "{:?}",
        oracle.losses
    );
    assert!(
        oracle
            .weights
            .iter()
            .all(|(name, _)| name != "lm_head.weight"),
        "a tied head has no weight of its own"
    );
    let mut ddp = base.clone();
    ddp.strategy = Strategy::Ddp;
    ddp.dp = 2;
    assert_close(&oracle, &run(&ddp), "tied, DDP with 2 ranks");
    // ZeRO-3 shards the embedding once, with the first unit; the last unit reads it again.
    for stage in STAGES {
        let sharded = zero(&base, 2, stage);
        assert_close(&oracle, &run(&sharded), &format!("tied, {stage:?} at dp 2"));
    }
}
