//! DistributedDataParallel on a small network: replicas start and stay equal, gradients are the
//! average of the ranks' (one device on the union of the batches), buckets start during
//! backward, a weight used twice is reduced correctly, and a parameter without a gradient is
//! named on every rank.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_comm::launch;
use burn_ddp::{DdpConfig, DdpError, DistributedDataParallel};

type AD = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    first: Param<Tensor<B, 2>>,
    second: Param<Tensor<B, 2>>,
    extra: Param<Tensor<B, 2>>,
}

impl<B: Backend> Net<B> {
    fn new(seed: u64) -> Self {
        let w = |k| Param::from_tensor(values([6, 6], seed * 3 + k, 0.5));
        Self {
            first: w(0),
            second: w(1),
            extra: w(2),
        }
    }

    /// `tied` uses `first` again at the end (a weight used twice); `use_extra` decides whether
    /// `extra` gets a gradient at all.
    fn loss(&self, x: Tensor<B, 2>, tied: bool, use_extra: bool) -> Tensor<B, 1> {
        let mut h = x.matmul(self.first.val()).tanh();
        h = h.matmul(self.second.val()).tanh();
        if use_extra {
            h = h.matmul(self.extra.val()).tanh();
        }
        if tied {
            h = h.matmul(self.first.val());
        }
        h.powi_scalar(2).mean()
    }
}

/// Reproducible values in `[-scale, scale)` from `seed` (burn's own generator is shared by the
/// rank threads, so it cannot give each rank its own stream).
fn values<B: Backend>(shape: [usize; 2], seed: u64, scale: f32) -> Tensor<B, 2> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let data: Vec<f32> = (0..shape[0] * shape[1])
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_data(TensorData::new(data, shape), &Default::default())
}

fn batch(rows: usize, seed: u64) -> Tensor<AD, 2> {
    values([rows, 6], 1000 + seed, 1.0)
}

fn flat(grads: &GradientsParams, net: &Net<AD>) -> Vec<f32> {
    [&net.first, &net.second, &net.extra]
        .iter()
        .flat_map(|p| {
            grads
                .get::<Flex, 2>(p.id)
                .map(|g| g.into_data().to_vec::<f32>().unwrap())
                .unwrap_or_default()
        })
        .collect()
}

/// One device: the gradient of the mean loss over the two halves of the batch.
fn reference(tied: bool) -> Vec<f32> {
    let net = Net::<AD>::new(0);
    let x = batch(8, 99);
    let halves = [x.clone().narrow(0, 0, 4), x.narrow(0, 4, 4)];
    let loss =
        (net.loss(halves[0].clone(), tied, true) + net.loss(halves[1].clone(), tied, true)) / 2.0;
    flat(&GradientsParams::from_grads(loss.backward(), &net), &net)
}

fn ddp_grads(tied: bool, config: DdpConfig) -> Vec<(Vec<f32>, usize, usize)> {
    launch(2, |ctx| {
        let net = Net::<AD>::new(ctx.rank() as u64 * 7);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), config.clone())?;
        let x = batch(8, 99).narrow(0, 4 * ctx.rank(), 4);
        let grads = ddp.backward(ddp.module().loss(x, tied, true))?;
        let stats = ddp.stats();
        Ok::<_, DdpError>((
            flat(&grads, ddp.module()),
            stats.buckets,
            stats.overlapped_buckets,
        ))
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn assert_near(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{x} vs {y}");
    }
}

#[test]
fn averaged_gradients_equal_one_device_and_buckets_start_during_backward() {
    let want = reference(false);
    // One small bucket per parameter: the last layers' buckets can start before backward ends.
    let results = ddp_grads(false, DdpConfig::new().with_bucket_cap_bytes(1));
    assert_eq!(results[0].0, results[1].0, "ranks got different gradients");
    assert_near(&results[0].0, &want);
    let (_, buckets, overlapped) = results[0];
    assert_eq!(buckets, 3);
    assert!(
        overlapped >= 2,
        "only {overlapped} of 3 buckets started during backward"
    );
    let serial = ddp_grads(false, DdpConfig::new().with_overlap(false));
    assert_eq!(serial[0].2, 0);
    assert_eq!(serial[0].0, results[0].0);
}

#[test]
fn a_weight_used_twice_gets_both_contributions() {
    let want = reference(true);
    for config in [
        DdpConfig::new().with_bucket_cap_bytes(1),
        DdpConfig::new().with_overlap(false),
    ] {
        let results = ddp_grads(true, config);
        assert_near(&results[0].0, &want);
        assert_eq!(results[0].0, results[1].0);
    }
}

#[test]
fn after_the_first_step_a_weight_used_twice_waits_at_the_back() {
    let want = reference(true);
    let results = launch(2, |ctx| {
        let net = Net::<AD>::new(0);
        let config = DdpConfig::new().with_bucket_cap_bytes(1);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), config)?;
        let x = || batch(8, 99).narrow(0, 4 * ctx.rank(), 4);
        ddp.backward(ddp.module().loss(x(), true, true))?;
        let grads = ddp.backward(ddp.module().loss(x(), true, true))?;
        Ok::<_, DdpError>((flat(&grads, ddp.module()), ddp.stats(), ddp.buckets()))
    });
    for result in results {
        let (grads, stats, buckets) = result.unwrap();
        assert_near(&grads, &want);
        assert_eq!(buckets.last().unwrap(), &vec!["first".to_string()]);
        assert_eq!(stats.overlapped_buckets, 2, "{buckets:?}");
    }
}

#[test]
fn ranks_may_differ_in_which_weights_get_late_parts() {
    // Rank 0 uses `first` twice, rank 1 once: the late all-reduce must still match.
    let net = Net::<AD>::new(0);
    let x = batch(8, 99);
    let loss = (net.loss(x.clone().narrow(0, 0, 4), true, true)
        + net.loss(x.narrow(0, 4, 4), false, true))
        / 2.0;
    let want = flat(&GradientsParams::from_grads(loss.backward(), &net), &net);
    let results = launch(2, |ctx| {
        let net = Net::<AD>::new(0);
        let config = DdpConfig::new().with_bucket_cap_bytes(1);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), config)?;
        let x = batch(8, 99).narrow(0, 4 * ctx.rank(), 4);
        let grads = ddp.backward(ddp.module().loss(x, ctx.rank() == 0, true))?;
        Ok::<_, DdpError>(flat(&grads, ddp.module()))
    });
    for result in results {
        assert_near(&result.unwrap(), &want);
    }
}

#[test]
fn frozen_parameters_are_synchronised_but_not_reduced() {
    let results = launch(2, |ctx| {
        let mut net = Net::<AD>::new(ctx.rank() as u64);
        net.extra = net.extra.set_require_grad(false);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), DdpConfig::new())?;
        let grads = ddp.backward(ddp.module().loss(batch(2, 5), false, true))?;
        let extra = ddp
            .module()
            .extra
            .val()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        Ok::<_, DdpError>((grads.get::<Flex, 2>(ddp.module().extra.id).is_none(), extra))
    });
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert!(results[0].0 && results[1].0);
    assert_eq!(
        results[0].1, results[1].1,
        "rank 0's frozen weight reached rank 1"
    );
}

#[test]
fn an_untracked_loss_is_refused() {
    let results = launch(1, |ctx| {
        let net = Net::<AD>::new(0);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), DdpConfig::new())?;
        let loss = ddp.module().loss(batch(2, 5), false, true).detach();
        ddp.backward(loss).map(|_| ())
    });
    let message = results.into_iter().next().unwrap().unwrap_err().to_string();
    assert!(
        message.contains("does not depend on any parameter"),
        "{message}"
    );
}

#[test]
fn replicas_start_from_rank_0_and_stay_bit_identical() {
    let weights = launch(3, |ctx| {
        let net = Net::<AD>::new(ctx.rank() as u64 + 1);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), DdpConfig::new())?;
        let mut sgd = SgdConfig::new().init();
        for step in 0..3 {
            let x = batch(2, 10 * step + ctx.rank() as u64);
            let grads = ddp.backward(ddp.module().loss(x, true, true))?;
            ddp.step(&mut sgd, 0.1, grads);
        }
        let net = ddp.into_module();
        Ok::<_, DdpError>(
            [net.first, net.second, net.extra]
                .map(|p| p.val().into_data().to_vec::<f32>().unwrap())
                .concat(),
        )
    });
    let weights: Vec<Vec<f32>> = weights.into_iter().map(|w| w.unwrap()).collect();
    assert_eq!(weights[0], weights[1]);
    assert_eq!(weights[0], weights[2]);
    let rank_0_start = Net::<AD>::new(1)
        .first
        .val()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_ne!(
        weights[0][..36],
        rank_0_start[..],
        "training moved the weights"
    );
}

#[test]
fn a_parameter_without_gradient_on_one_rank_is_named_on_every_rank() {
    let results = launch(2, |ctx| {
        let net = Net::<AD>::new(0);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), DdpConfig::new())?;
        let use_extra = ctx.rank() == 0;
        ddp.backward(ddp.module().loss(batch(2, 1), false, use_extra))?;
        Ok::<_, DdpError>(())
    });
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(message.contains("`extra` on rank(s) [1]"), "{message}");
    }
    // Allowed, it counts as zero on rank 1: the average is half of rank 0's gradient.
    let results = launch(2, |ctx| {
        let net = Net::<AD>::new(0);
        let config = DdpConfig::new().with_allow_unused_parameters(true);
        let mut ddp = DistributedDataParallel::new(net, ctx.world().clone(), config)?;
        let grads = ddp.backward(ddp.module().loss(batch(2, 1), false, ctx.rank() == 0))?;
        Ok::<_, DdpError>(grads.get::<Flex, 2>(ddp.module().extra.id).is_some())
    });
    assert!(results.into_iter().all(|r| r.unwrap()));
}

#[test]
fn data_parallel_refuses_a_batch_that_does_not_split_on_every_rank_at_once() {
    use burn::tensor::Int;
    use burn_ddp::DataParallel;
    let started = std::time::Instant::now();
    let results = launch(2, |ctx| {
        let dp = DataParallel::new(Net::<AD>::new(0), ctx.world().clone())?;
        let device = Default::default();
        let global = (ctx.rank() == 0).then(|| Tensor::<AD, 2, Int>::zeros([7, 3], &device));
        dp.scatter(global, &device).map(|_| ())
    });
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(message.contains("multiple of 2"), "{message}");
    }
    assert!(
        started.elapsed().as_secs() < 10,
        "an error must not wait for a timeout"
    );
}

#[test]
fn a_step_fed_in_pieces_gives_the_bits_of_no_sync_then_backward() {
    // Each rank's 4 rows in 2 micro-batches; `first` is used twice, so it gets late parts.
    let results = launch(2, |ctx| {
        let net = Net::<AD>::new(0);
        let config = DdpConfig::new().with_bucket_cap_bytes(1);
        let micro = |mb: usize| batch(8, 99).narrow(0, 4 * ctx.rank() + 2 * mb, 2);
        let loss = |mb| net.loss(micro(mb), true, true) / 2.0;

        let mut plain = burn_ddp::GradientSync::new(&net, ctx.world().clone(), config.clone())?;
        plain.backward_no_sync(&net, loss(0));
        let want = plain.backward(&net, loss(1))?;

        let mut pieces = burn_ddp::GradientSync::new(&net, ctx.world().clone(), config)?;
        let mut step = pieces.begin(&net)?;
        step.accumulate(&net, &mut loss(0).backward());
        step.backward_of(&net, loss(1));
        let got = step.finish()?;
        Ok::<_, DdpError>((flat(&got, &net), flat(&want, &net), pieces.stats()))
    });
    for result in results {
        let (got, want, stats) = result.unwrap();
        assert_eq!(got, want);
        assert!(stats.overlapped_buckets > 0, "{stats:?}");
    }
}

#[test]
fn finishing_a_step_before_every_gradient_is_in_names_the_missing_ones() {
    let results = launch(1, |ctx| {
        let net = Net::<AD>::new(0);
        let mut sync = burn_ddp::GradientSync::new(&net, ctx.world().clone(), DdpConfig::new())?;
        let step = sync.begin(&net)?;
        step.finish().map(|_| ())
    });
    let error = results[0].as_ref().unwrap_err().to_string();
    assert!(
        error.contains("never taken") && error.contains("first") && error.contains("extra"),
        "{error}"
    );
}

/// dp 2 x ep 2: `extra` stands for an expert weight, held alike by the ranks of one colour
/// (`rank % 2`) and differently by the others. It starts from its own group's first rank,
/// and its gradient is the sum over its group divided by the whole group's size; the others
/// are averaged over all four ranks.
#[test]
fn experts_are_synchronised_and_reduced_over_the_ranks_holding_them() {
    let expert_value = |rank: usize| values::<AD>([6, 6], 50 + rank as u64, 0.5);
    // Each rank's own gradient, from the weights it will hold once wrapped.
    let local = |rank: usize| {
        let mut net = Net::<AD>::new(1);
        net.extra = Param::from_tensor(expert_value(rank % 2).require_grad());
        let grads = GradientsParams::from_grads(
            net.loss(batch(3, rank as u64), false, true).backward(),
            &net,
        );
        flat(&grads, &net)
    };
    let locals: Vec<Vec<f32>> = (0..4).map(local).collect();
    let n = 36;
    for (overlap, cap) in [(true, 1), (false, 1 << 20)] {
        let config = DdpConfig::new()
            .with_overlap(overlap)
            .with_bucket_cap_bytes(cap);
        let results = launch(4, |ctx| {
            let rank = ctx.rank();
            let mut net = Net::<AD>::new(1);
            net.extra = Param::from_tensor(expert_value(rank).require_grad());
            let experts = burn_ddp::ExpertGroup {
                comm: ctx.world().split("ep peers", rank % 2)?,
                params: [net.extra.id].into_iter().collect(),
            };
            let mut ddp = DistributedDataParallel::with_experts(
                net,
                ctx.world().clone(),
                Some(experts),
                config.clone(),
            )?;
            let held = ddp.module().extra.val().into_data();
            let grads = ddp.backward(ddp.module().loss(batch(3, rank as u64), false, true))?;
            Ok::<_, DdpError>((held, flat(&grads, ddp.module())))
        });
        for (rank, result) in results.into_iter().enumerate() {
            let (held, got) = result.unwrap();
            assert_eq!(
                held,
                expert_value(rank % 2).into_data(),
                "rank {rank}'s expert"
            );
            let dense = |i: usize| locals.iter().map(|l| l[i]).sum::<f32>() / 4.0;
            let expert = |i: usize| (locals[rank % 2][i] + locals[rank % 2 + 2][i]) / 4.0;
            let want: Vec<f32> = (0..3 * n)
                .map(|i| if i >= 2 * n { expert(i) } else { dense(i) })
                .collect();
            assert_near(&got, &want);
        }
    }
}

#[test]
fn an_expert_group_that_is_not_a_part_of_the_group_is_refused() {
    let results = launch(5, |ctx| {
        let net = Net::<AD>::new(1);
        let experts = burn_ddp::ExpertGroup {
            // Neither two ranks nor three are a part of five.
            comm: ctx.world().split("odd", usize::from(ctx.rank() < 2))?,
            params: [net.extra.id].into_iter().collect(),
        };
        let refused = DistributedDataParallel::with_experts(
            net,
            ctx.world().clone(),
            Some(experts),
            DdpConfig::new(),
        )
        .err()
        .map(|e| e.to_string());
        Ok::<_, burn_comm::CommError>(refused)
    });
    for result in results {
        let error = result.unwrap().expect("refused");
        assert!(
            error.contains("not a part of the 5 data-parallel ranks"),
            "{error}"
        );
    }
}
