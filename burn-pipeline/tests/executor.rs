//! The executor against one device: a chain of `tanh(x W)` layers with a squared-error loss,
//! cut into stages, gives the same loss and the same weight gradients as the whole chain
//! trained with gradient accumulation, under every schedule, with and without recompute; in
//! bf16 as in fp32, and under a loss scale; with data-parallel replicas, their gradients
//! averaged during the last backwards give the bits of averaging after the drain.

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, Tensor, TensorData};
use burn_ddp::{DdpConfig, GradientSync};
use burn_pipeline::{
    Message, PipelineError, PipelineExecutor, PipelineStage, Schedule, ScheduleKind, StageOutput,
    balance,
};

type B = Autodiff<Flex>;
type Inner = Flex;

const HIDDEN: usize = 6;
const MICRO: usize = 3;
const SEQ: usize = 2;

#[derive(Module, Debug)]
struct Chain<B: Backend> {
    layers: Vec<Param<Tensor<B, 2>>>,
    first: bool,
    last: bool,
}

type Batch = (Tensor<B, 3>, Tensor<B, 3>);

impl Chain<B> {
    fn run(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.layers.iter().fold(x, |x, w| {
            burn::tensor::activation::tanh(x.matmul(w.val().unsqueeze()))
        })
    }
}

impl PipelineStage<B> for Chain<B> {
    type Batch = Batch;
    type Error = PipelineError;

    fn forward(
        &self,
        input: Option<Tensor<B, 3>>,
        batch: &Batch,
    ) -> Result<StageOutput<B>, PipelineError> {
        let x = match (self.first, input) {
            (true, None) => batch.0.clone(),
            (false, Some(x)) => x,
            _ => return Err(PipelineError::Config("wrong input for the stage".into())),
        };
        let y = self.run(x);
        Ok(if self.last {
            let diff = y - batch.1.clone();
            StageOutput::Loss((diff.clone() * diff).mean())
        } else {
            StageOutput::Activation(y)
        })
    }
}

fn weights(layers: usize) -> Vec<Vec<f32>> {
    (0..layers)
        .map(|l| {
            (0..HIDDEN * HIDDEN)
                .map(|i| (((l * 31 + i * 17) % 23) as f32 / 23.0 - 0.5) * 0.9)
                .collect()
        })
        .collect()
}

fn batches(micro_batches: usize, dtype: DType) -> Vec<Batch> {
    let device = Default::default();
    let tensor = |seed: usize| {
        let values: Vec<f32> = (0..MICRO * SEQ * HIDDEN)
            .map(|i| (((seed * 13 + i * 7) % 19) as f32 / 19.0 - 0.5) * 2.0)
            .collect();
        Tensor::<B, 3>::from_data(TensorData::new(values, [MICRO, SEQ, HIDDEN]), &device)
            .cast(dtype)
    };
    (0..micro_batches)
        .map(|mb| (tensor(2 * mb), tensor(2 * mb + 1)))
        .collect()
}

fn param(values: &[f32], dtype: DType) -> Param<Tensor<B, 2>> {
    let tensor: Tensor<B, 2> = Tensor::from_data(
        TensorData::new(values.to_vec(), [HIDDEN, HIDDEN]),
        &Default::default(),
    );
    Param::from_tensor(tensor.cast(dtype))
}

fn values(tensor: Tensor<Inner, 2>) -> Vec<f32> {
    tensor.into_data().convert::<f32>().to_vec().unwrap()
}

/// How a pipelined run computes: its parameters' and inputs' dtype, the dtype its receivers
/// expect, and its loss scale.
#[derive(Clone, Copy)]
struct Numerics {
    dtype: DType,
    message: DType,
    loss_scale: f64,
}

const FP32: Numerics = Numerics {
    dtype: DType::F32,
    message: DType::F32,
    loss_scale: 1.0,
};

/// Loss and per-layer gradients of the whole chain on one device, in `dtype`.
fn reference(layers: usize, micro_batches: usize, dtype: DType) -> (f64, Vec<Vec<f32>>) {
    let chain = Chain {
        layers: weights(layers).iter().map(|w| param(w, dtype)).collect(),
        first: true,
        last: true,
    };
    let mut accumulator = GradientsAccumulator::new();
    let mut loss_sum = 0.0;
    for batch in batches(micro_batches, dtype) {
        let StageOutput::Loss(loss) = chain.forward(None, &batch).unwrap() else {
            unreachable!()
        };
        let loss = loss / micro_batches as f64;
        loss_sum += loss.clone().into_scalar().elem::<f64>();
        accumulator.accumulate(&chain, GradientsParams::from_grads(loss.backward(), &chain));
    }
    let grads = accumulator.grads();
    let per_layer = chain
        .layers
        .iter()
        .map(|w| values(grads.get::<Inner, 2>(w.id).unwrap()))
        .collect();
    (loss_sum, per_layer)
}

/// This rank's chunks of the chain cut at `ranges`, in `dtype`.
fn chunks(
    executor: &PipelineExecutor,
    ranges: &[std::ops::Range<usize>],
    layers: usize,
    dtype: DType,
) -> Vec<Chain<B>> {
    let all = weights(layers);
    executor
        .stages()
        .into_iter()
        .map(|s| Chain {
            layers: all[ranges[s].clone()]
                .iter()
                .map(|w| param(w, dtype))
                .collect(),
            first: s == 0,
            last: s + 1 == ranges.len(),
        })
        .collect()
}

/// The gradient of every layer this rank holds, by layer index.
fn per_layer(
    executor: &PipelineExecutor,
    ranges: &[std::ops::Range<usize>],
    chunks: &[Chain<B>],
    grads: &GradientsParams,
) -> Vec<(usize, Vec<f32>)> {
    executor
        .stages()
        .into_iter()
        .zip(chunks)
        .flat_map(|(s, chunk)| {
            ranges[s].clone().zip(&chunk.layers).map(move |(layer, w)| {
                (
                    layer,
                    values(grads.get::<Inner, 2>(w.id).expect("a gradient")),
                )
            })
        })
        .collect()
}

/// Loss and per-layer gradients of the chain cut into stages and run under `kind`.
fn pipelined(
    kind: ScheduleKind,
    ranks: usize,
    virtual_stages: usize,
    layers: usize,
    micro_batches: usize,
    recompute: bool,
    numerics: Numerics,
) -> Result<(f64, Vec<Vec<f32>>), PipelineError> {
    let ranges = balance(&vec![1.0; layers], ranks * virtual_stages, 0.0, 0.0).unwrap();
    let origin = Instant::now();
    let results = burn_comm::launch(ranks, |ctx| {
        let schedule = Schedule::new(kind, ranks, micro_batches, virtual_stages)?;
        let executor =
            PipelineExecutor::new(schedule, ctx.world().clone())?.with_recompute(recompute);
        let chunks = chunks(&executor, &ranges, layers, numerics.dtype);
        let out = executor.step(
            &chunks,
            &batches(micro_batches, numerics.dtype),
            Message::new([MICRO, SEQ, HIDDEN], numerics.message),
            numerics.loss_scale,
            &Default::default(),
            origin,
        )?;
        let grads = per_layer(&executor, &ranges, &chunks, &out.grads);
        Ok::<_, PipelineError>((out.loss, grads))
    });
    let mut loss = None;
    let mut per_layer = vec![Vec::new(); layers];
    for result in results {
        let (rank_loss, grads) = result.map_err(|e| PipelineError::Config(e.to_string()))?;
        loss = loss.or(rank_loss);
        for (layer, grad) in grads {
            per_layer[layer] = grad;
        }
    }
    Ok((loss.expect("the last stage reports the loss"), per_layer))
}

fn assert_matches(what: &str, got: (f64, Vec<Vec<f32>>), want: &(f64, Vec<Vec<f32>>)) {
    assert!(
        (got.0 - want.0).abs() <= 1e-6 * want.0.abs(),
        "{what}: loss {} vs {}",
        got.0,
        want.0
    );
    for (layer, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: layer {layer} has no gradient");
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                "{what}: layer {layer} gradient {a} vs {b}"
            );
        }
    }
}

#[test]
fn every_schedule_gives_the_gradients_of_one_device() {
    let micro_batches = 4;
    let layers = 8;
    let want = reference(layers, micro_batches, DType::F32);
    let cases = [
        (ScheduleKind::Gpipe, 2, 1),
        (ScheduleKind::OneFOneB, 2, 1),
        (ScheduleKind::OneFOneB, 4, 1),
        (ScheduleKind::Interleaved, 2, 2),
        (ScheduleKind::Interleaved, 4, 2),
        (ScheduleKind::ZeroBubbleH1, 2, 1),
        (ScheduleKind::ZeroBubbleH1, 4, 1),
        (ScheduleKind::Interleaved, 1, 4),
    ];
    for (kind, ranks, v) in cases {
        for recompute in [false, true] {
            let what = format!("{kind} pp {ranks} v {v} recompute {recompute}");
            let got = pipelined(kind, ranks, v, layers, micro_batches, recompute, FP32)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_matches(&what, got, &want);
        }
    }
}

#[test]
fn bad_layouts_are_refused() {
    let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
    let results = burn_comm::launch(3, |ctx| {
        PipelineExecutor::new(schedule.clone(), ctx.world().clone()).map(|_| ())
    });
    let error = results[0].as_ref().unwrap_err().to_string();
    assert!(
        error.contains("2 pipeline ranks but the group has 3"),
        "{error}"
    );
}

#[test]
fn bf16_stages_send_bf16_and_give_the_bits_of_one_device() {
    let (layers, micro_batches) = (8, 4);
    let want = reference(layers, micro_batches, DType::BF16);
    let bf16 = Numerics {
        dtype: DType::BF16,
        message: DType::BF16,
        loss_scale: 1.0,
    };
    for (kind, ranks, v) in [
        (ScheduleKind::OneFOneB, 2, 1),
        (ScheduleKind::Interleaved, 2, 2),
        (ScheduleKind::ZeroBubbleH1, 4, 1),
    ] {
        let got = pipelined(kind, ranks, v, layers, micro_batches, false, bf16)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got, want, "bf16 {kind} pp {ranks} v {v}");
    }
    // Stages that send bf16 to a receiver expecting fp32 are named, not misread.
    let expects_fp32 = Numerics {
        message: DType::F32,
        ..bf16
    };
    let error = pipelined(
        ScheduleKind::OneFOneB,
        2,
        1,
        layers,
        micro_batches,
        false,
        expects_fp32,
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("BF16") && error.contains("F32"), "{error}");
}

#[test]
fn a_loss_scale_scales_every_gradient_exactly_and_not_the_loss() {
    let (layers, micro_batches) = (8, 4);
    let scale = 2f64.powi(10);
    let scaled = Numerics {
        loss_scale: scale,
        ..FP32
    };
    for (kind, ranks, v) in [
        (ScheduleKind::Gpipe, 2, 1),
        (ScheduleKind::ZeroBubbleH1, 4, 1),
    ] {
        let run = |numerics| {
            pipelined(kind, ranks, v, layers, micro_batches, false, numerics)
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let (plain, got) = (run(FP32), run(scaled));
        assert_eq!(got.0, plain.0, "{kind}: the reported loss is unscaled");
        for (layer, (g, p)) in got.1.iter().zip(&plain.1).enumerate() {
            let times: Vec<f32> = p.iter().map(|x| x * scale as f32).collect();
            assert_eq!(
                g, &times,
                "{kind}: layer {layer} gradient, times 2^10 exactly"
            );
        }
    }
    let error = pipelined(
        ScheduleKind::Gpipe,
        2,
        1,
        layers,
        micro_batches,
        false,
        Numerics {
            loss_scale: 0.0,
            ..FP32
        },
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("loss scale"), "{error}");
}

/// Loss and per-layer gradients of dp 2 x pp 2 (replica `d` taking micro-batches `d * m..`),
/// the replicas averaging either through the executor's sink (`overlap`) or once the pipeline
/// has drained; and the buckets each rank started during a backward.
fn data_parallel(
    kind: ScheduleKind,
    virtual_stages: usize,
    layers: usize,
    micro_batches: usize,
    recompute: bool,
    overlap: bool,
) -> ((f64, Vec<Vec<f32>>), Vec<usize>) {
    let (dp, pp) = (2, 2);
    let ranges = balance(&vec![1.0; layers], pp * virtual_stages, 0.0, 0.0).unwrap();
    let every_batch = batches(dp * micro_batches, DType::F32);
    let results = burn_comm::launch(dp * pp, |ctx| {
        let mesh = ctx.mesh(&[("dp", dp), ("pp", pp)])?;
        let replica = mesh.coord("dp")?;
        let schedule = Schedule::new(kind, pp, micro_batches, virtual_stages)?;
        let executor =
            PipelineExecutor::new(schedule, mesh.group("pp")?.clone())?.with_recompute(recompute);
        let chunks = chunks(&executor, &ranges, layers, DType::F32);
        // One bucket per parameter, so a chunk's backward can start some before it ends.
        let config = DdpConfig::new().with_bucket_cap_bytes(1);
        let mut sync = GradientSync::new(&chunks, mesh.group("dp")?.clone(), config)
            .map_err(|e| PipelineError::Config(e.to_string()))?;
        let mine = &every_batch[replica * micro_batches..(replica + 1) * micro_batches];
        let message = Message::new([MICRO, SEQ, HIDDEN], DType::F32);
        let (device, origin) = (Default::default(), Instant::now());
        let (run, grads) = if overlap {
            let mut sink = sync.begin(&chunks).unwrap();
            let run = executor.step_into(&chunks, mine, message, &device, origin, &mut sink)?;
            (run.loss, sink.finish())
        } else {
            let out = executor.step(&chunks, mine, message, 1.0, &device, origin)?;
            (out.loss, sync.average(&chunks, out.grads))
        };
        let grads = grads.map_err(|e| PipelineError::Config(e.to_string()))?;
        let per_layer = per_layer(&executor, &ranges, &chunks, &grads);
        let loss = mesh
            .group("dp")?
            .all_reduce(
                Tensor::<Inner, 1>::from_floats([run.unwrap_or(0.0) as f32], &device),
                burn_comm::ReduceOp::Avg,
            )?
            .into_scalar()
            .elem::<f64>();
        Ok::<_, PipelineError>((
            run.map(|_| loss),
            per_layer,
            sync.stats().overlapped_buckets,
        ))
    });
    let mut loss = None;
    let mut per_layer = vec![Vec::new(); layers];
    let mut overlapped = Vec::new();
    for result in results {
        let (rank_loss, grads, started) = result.unwrap_or_else(|e| panic!("{e}"));
        loss = loss.or(rank_loss);
        overlapped.push(started);
        for (layer, grad) in grads {
            per_layer[layer] = grad;
        }
    }
    (
        (loss.expect("the last stage reports the loss"), per_layer),
        overlapped,
    )
}

#[test]
fn data_parallel_pipelines_average_during_their_last_backwards() {
    let (layers, micro_batches) = (8, 4);
    // One device over both replicas' micro-batches.
    let want = reference(layers, 2 * micro_batches, DType::F32);
    for (kind, v, recompute) in [
        (ScheduleKind::OneFOneB, 1, false),
        (ScheduleKind::OneFOneB, 1, true),
        (ScheduleKind::Interleaved, 2, false),
        (ScheduleKind::ZeroBubbleH1, 1, false),
    ] {
        let what = format!("dp 2 x pp 2 {kind} v {v} recompute {recompute}");
        let run = |overlap| data_parallel(kind, v, layers, micro_batches, recompute, overlap);
        let ((overlapped, started), (drained, none)) = (run(true), run(false));
        // The same sums averaged in the same buckets: the same bits, whenever they start.
        assert_eq!(
            overlapped.1, drained.1,
            "{what}: overlapped vs after the drain"
        );
        assert_matches(&what, overlapped, &want);
        assert!(
            started.iter().all(|&n| n > 0),
            "{what}: every rank starts buckets during its backwards: {started:?}"
        );
        assert!(none.iter().all(|&n| n == 0), "{what}: {none:?}");
    }
}
