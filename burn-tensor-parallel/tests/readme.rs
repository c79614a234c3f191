//! The README's burn-tensor-parallel example, made concrete: an MLP split over 2 ranks gives
//! the dense MLP's output, and its weights gather back whole.

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::gelu;
use burn::tensor::{Distribution, Tensor};
use burn_tensor_parallel::{ColumnParallelLinear, RowParallelLinear, TensorParallel, TpError};

type B = Autodiff<Flex>;

#[test]
fn readme_example_matches_the_dense_mlp() {
    let device = Default::default();
    let x = Tensor::<B, 3>::random([2, 8, 16], Distribution::Default, &device);
    let w1 = Tensor::<B, 2>::random([16, 64], Distribution::Default, &device);
    let w2 = Tensor::<B, 2>::random([64, 16], Distribution::Default, &device);
    let dense = gelu(x.clone().matmul(w1.clone().unsqueeze())).matmul(w2.clone().unsqueeze());

    let results = burn_comm::launch(2, |ctx| {
        let tp = TensorParallel::new(ctx.world().clone()); // .with_sequence_parallel(true) for SP
        // Every rank holds the full weights (same seed), and keeps its slice.
        let up = ColumnParallelLinear::from_full(w1.clone(), None, &tp, false)?; // [16, 64/tp]
        let down = RowParallelLinear::from_full(w2.clone(), None, &tp, true)?; // [64/tp, 16]
        let y = down.forward(gelu(up.forward(x.clone())?))?; // 1 all-reduce forward, 1 backward
        let (w1_full, _) = up.full()?; // gathered back, for export
        Ok::<_, TpError>((y, w1_full))
    });

    for result in results {
        let (y, w1_full) = result.unwrap();
        y.into_data()
            .assert_approx_eq::<f32>(&dense.clone().into_data(), Default::default());
        w1_full.into_data().assert_eq(&w1.clone().into_data(), true);
    }
}
