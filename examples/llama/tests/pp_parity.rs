//! Pipeline parallelism against the oracle: `tiny` trained 20 steps on one device, and cut
//! into 2 and 4 pipeline stages under every schedule (4 micro-batches per step), with
//! activation recompute, on a 2 x 2 data x pipeline mesh, with tensor-parallel stages (and
//! sequence parallelism, and all three on a 2 x 2 x 2 mesh), and split by measured time. Interleaving 4 ranks x 2 chunks
//! needs 8 blocks, so that case trains `tiny` with 8 layers against its own oracle. Llama 3's
//! scaled rotary positions are checked in each way of splitting the model (tp + sp, pp,
//! pp x tp) against their own one-device oracle. A head tied to the embedding matches one
//! device under pp (1F1B, interleaved, ZB-H1 at pp 4), dp x pp with DDP and ZeRO-1, and pp x tp.
//! A bf16 checkpoint in shards, which each rank reads only its slices of, trains under pp x tp
//! and dp x tp with ZeRO-3 as one device trains from it.
//!
//! Tolerances are in `common`: micro-batch means summed one by one differ in float32 rounding
//! from one mean over the whole batch.

mod common;

use burn::backend::Flex;
use burn::tensor::DType;
use burn_pipeline::ScheduleKind;
use burn_zero::ZeroStage;
use common::*;
use llama::Llama;
use llama::rope::RopeScaling;
use llama::train::{Strategy, TrainConfig};

fn pipelined(
    base: &TrainConfig,
    pp: usize,
    schedule: ScheduleKind,
    virtual_stages: usize,
    recompute: bool,
) -> Run {
    let mut config = base.clone();
    config.pp = pp;
    config.grad_accum = Some(4);
    config.schedule = schedule;
    config.virtual_stages = virtual_stages;
    config.recompute = recompute;
    run(&config)
}

#[test]
fn every_schedule_matches_one_device_at_pp_2_and_4() {
    let base = config(Strategy::Single, 1);
    let oracle = run(&base);
    for (pp, schedule, v) in [
        (2, ScheduleKind::Gpipe, 1),
        (2, ScheduleKind::OneFOneB, 1),
        (2, ScheduleKind::Interleaved, 2),
        (2, ScheduleKind::ZeroBubbleH1, 1),
        (4, ScheduleKind::Gpipe, 1),
        (4, ScheduleKind::OneFOneB, 1),
        (4, ScheduleKind::ZeroBubbleH1, 1),
    ] {
        let what = format!("pp {pp} {schedule} v {v}");
        assert_close(&oracle, &pipelined(&base, pp, schedule, v, false), &what);
    }
}

#[test]
fn interleaving_four_ranks_matches_one_device() {
    let mut base = config(Strategy::Single, 1);
    base.model.num_hidden_layers = 8;
    let oracle = run(&base);
    let run = pipelined(&base, 4, ScheduleKind::Interleaved, 2, false);
    assert_close(&oracle, &run, "pp 4 interleaved v 2 (8 layers)");
}

#[test]
fn recompute_and_data_parallel_pipelines_match_one_device() {
    let base = config(Strategy::Single, 1);
    let oracle = run(&base);
    assert_close(
        &oracle,
        &pipelined(&base, 2, ScheduleKind::OneFOneB, 1, true),
        "pp 2 1f1b recompute",
    );
    assert_close(
        &oracle,
        &pipelined(&base, 2, ScheduleKind::ZeroBubbleH1, 1, true),
        "pp 2 zb-h1 recompute",
    );
    let mut config = base.clone();
    config.strategy = Strategy::Ddp;
    config.dp = 2;
    config.pp = 2;
    config.grad_accum = Some(2);
    assert_close(&oracle, &run(&config), "dp 2 x pp 2 1f1b");
}

#[test]
fn tensor_parallel_pipelines_and_a_time_balanced_split_match_one_device() {
    let base = config(Strategy::Single, 1);
    let oracle = run(&base);
    let with_tp = |pp: usize, schedule: ScheduleKind, v: usize, sp: bool| {
        let mut config = base.clone();
        config.pp = pp;
        config.tp = 2;
        config.sequence_parallel = sp;
        config.grad_accum = Some(4);
        config.schedule = schedule;
        config.virtual_stages = v;
        config
    };
    assert_close(
        &oracle,
        &run(&with_tp(2, ScheduleKind::OneFOneB, 1, false)),
        "pp 2 x tp 2 1f1b",
    );
    assert_close(
        &oracle,
        &run(&with_tp(2, ScheduleKind::ZeroBubbleH1, 1, true)),
        "pp 2 x tp 2 + sp zb-h1",
    );
    let mut config = with_tp(2, ScheduleKind::Interleaved, 2, false);
    config.strategy = Strategy::Ddp;
    config.dp = 2;
    config.grad_accum = Some(2);
    config.balance = llama::pipeline::Balance::Time;
    assert_close(
        &oracle,
        &run(&config),
        "dp 2 x pp 2 x tp 2 interleaved, balanced by time",
    );
    let mut config = base.clone();
    config.pp = 2;
    config.grad_accum = Some(4);
    config.schedule = ScheduleKind::Gpipe;
    config.balance = llama::pipeline::Balance::Time;
    assert_close(&oracle, &run(&config), "pp 2 gpipe balanced by time");
}

#[test]
fn scaled_rotary_positions_match_one_device_in_every_model_split() {
    // Llama 3's bands over `tiny`'s heads of 32 at base 10000: two frequencies kept, three
    // blended, eleven divided by the factor.
    let plain = config(Strategy::Single, 1);
    let mut base = plain.clone();
    base.model.rope_scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    };
    let oracle = run(&base);
    // A split that ignored the scaling would train the plain model: make sure that is told
    // apart by a wide margin.
    let (loss, weight) = deviations(&oracle, &run(&plain));
    eprintln!("scaled vs plain: {loss:?} {weight:?}");
    assert!(
        loss.relative > 10.0 * 1e-5 && weight.relative > 10.0 * 1e-4,
        "the scaling moves the losses by only {loss:?} and the weights by {weight:?}"
    );
    let mut tp = base.clone();
    tp.tp = 2;
    tp.sequence_parallel = true;
    assert_close(&oracle, &run(&tp), "llama3 rotary, tp 2 + sp");
    assert_close(
        &oracle,
        &pipelined(&base, 2, ScheduleKind::OneFOneB, 1, false),
        "llama3 rotary, pp 2 1f1b",
    );
    let mut both = base.clone();
    both.pp = 2;
    both.tp = 2;
    both.grad_accum = Some(4);
    assert_close(&oracle, &run(&both), "llama3 rotary, pp 2 x tp 2 1f1b");
}

#[test]
fn a_tied_head_matches_one_device_in_every_pipeline_layout() {
    // The last stage's copy of the embedding and the first stage's sum their gradients.
    let mut base = config(Strategy::Single, 1);
    base.model.tie_word_embeddings = true;
    let oracle = run(&base);
    for (pp, schedule, v) in [
        (2, ScheduleKind::OneFOneB, 1),
        (2, ScheduleKind::Interleaved, 2),
        (4, ScheduleKind::ZeroBubbleH1, 1),
    ] {
        let what = format!("tied, pp {pp} {schedule} v {v}");
        assert_close(&oracle, &pipelined(&base, pp, schedule, v, false), &what);
    }
    let layout = |dp: usize, tp: usize, zero: ZeroStage| {
        let mut config = base.clone();
        config.strategy = if dp > 1 {
            Strategy::Ddp
        } else {
            Strategy::Single
        };
        (config.dp, config.tp, config.pp, config.zero) = (dp, tp, 2, zero);
        config.grad_accum = Some(4 / dp);
        config
    };
    for (dp, tp, zero) in [
        (2, 1, ZeroStage::Replicated),
        (2, 1, ZeroStage::OptimizerState),
        (1, 2, ZeroStage::Replicated),
    ] {
        let what = format!("tied, dp {dp} x pp 2 x tp {tp}, {zero:?}");
        assert_close(&oracle, &run(&layout(dp, tp, zero)), &what);
    }
}

#[test]
fn a_bf16_checkpoint_read_in_slices_trains_like_one_device_from_it() {
    // `tiny` from another seed, in bf16, in shards with their index.
    let base = config(Strategy::Single, 1);
    let dir = std::env::temp_dir().join(format!("pp-parity-bf16-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = Llama::<Flex>::init(&base.model, 11, &Default::default());
    let tensors: Vec<_> = llama::hf::export(&model)
        .into_iter()
        .map(|(name, data)| (name, data.convert_dtype(DType::BF16)))
        .collect();
    llama::safetensors_files::write(&dir, &tensors, 1_000_000).unwrap();
    assert!(dir.join(llama::safetensors_files::INDEX).exists());
    let config = llama::hf_config::hf_config(&base.model);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut from = base.clone();
    from.init_from = Some(dir.clone());
    let oracle = run(&from);
    assert_ne!(
        oracle.losses[0],
        run(&base).losses[0],
        "the checkpoint, not the seed, is what trains"
    );
    let mut both = from.clone();
    (both.pp, both.tp, both.grad_accum) = (2, 2, Some(4));
    assert_close(&oracle, &run(&both), "bf16 checkpoint, pp 2 x tp 2");
    let mut sharded = zero(&from, 2, ZeroStage::Parameters);
    sharded.tp = 2;
    assert_close(
        &oracle,
        &run(&sharded),
        "bf16 checkpoint, dp 2 x tp 2, ZeRO-3",
    );
    std::fs::remove_dir_all(dir).unwrap();
}
