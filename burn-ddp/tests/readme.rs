//! The README's burn-ddp example, made concrete: a linear regression trained with DDP on 2
//! ranks, two micro-batches per step, from a shared sampler.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::SgdConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_ddp::{DdpConfig, DistributedDataParallel, DistributedSampler, per_rank_batch};

type AD = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Model<B: Backend> {
    weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Model<B> {
    /// Mean squared error of `x @ weight` against `2x` (the weight should become 2).
    fn loss(&self, x: Tensor<B, 2>) -> Tensor<B, 1> {
        let error = x.clone().matmul(self.weight.val()) - x * 2.0;
        error.powi_scalar(2).mean()
    }
}

#[test]
fn readme_example_trains() {
    let dataset_len = 64;
    let steps = 40;
    let sample = |i: usize| (i as f32 / 16.0) - 2.0;
    let results = burn_comm::launch(2, |ctx| {
        let device = Default::default();
        let model = Model::<AD> {
            weight: Param::from_tensor(Tensor::zeros([1, 1], &device)),
        };
        let mut optimizer = SgdConfig::new().init();
        let lr = 0.1;

        let comm = ctx.world().clone();
        let local_batch = per_rank_batch(16, comm.size())?; // an error if 16 does not divide
        let sampler = DistributedSampler::new(dataset_len, comm.size(), comm.rank())?.with_seed(7);
        let order = sampler.indices(0);
        let micro_batch = |step: usize, micro: usize| {
            let half = local_batch / 2;
            let start = (step * local_batch + micro * half) % order.len();
            let xs: Vec<f32> = (0..half)
                .map(|i| sample(order[(start + i) % order.len()]))
                .collect();
            Tensor::<AD, 2>::from_data(TensorData::new(xs, [half, 1]), &device)
        };
        // Rank 0's parameters go to every rank here.
        let mut ddp = DistributedDataParallel::new(model, comm, DdpConfig::new())?;
        for step in 0..steps {
            // Accumulate micro-batches locally, synchronise on the last one.
            ddp.backward_no_sync(ddp.module().loss(micro_batch(step, 0)) / 2.0);
            let grads = ddp.backward(ddp.module().loss(micro_batch(step, 1)) / 2.0)?; // averaged
            ddp.step(&mut optimizer, lr, grads);
        }
        Ok::<_, burn_ddp::DdpError>(ddp.into_module())
    });
    let weights: Vec<f32> = results
        .into_iter()
        .map(|r| r.unwrap().weight.val().into_scalar())
        .collect();
    assert_eq!(weights[0].to_bits(), weights[1].to_bits());
    assert!((weights[0] - 2.0).abs() < 1e-3, "{}", weights[0]);
}
