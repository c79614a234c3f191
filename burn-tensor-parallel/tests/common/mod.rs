//! What the parallel-layer tests share: seeded inputs, and the tolerance of a parallel result
//! against one device's.
#![allow(dead_code)]

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

/// The backend the reference and the inputs live on (the parallel runs wrap it in `Autodiff`).
pub type Inner = Flex;

/// Standard normal values of `shape`, the same for the same seed.
pub fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Inner, D> {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let values: Vec<f32> = (0..shape.iter().product())
        .map(|_| normal.sample(&mut rng))
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// `|a - b| <= 1e-5 max|b| + 1e-4 |b|` for every element (each test file says why).
#[track_caller]
pub fn assert_close<const D: usize>(got: Tensor<Inner, D>, want: Tensor<Inner, D>, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let got: Vec<f32> = got.into_data().to_vec().unwrap();
    let want: Vec<f32> = want.into_data().to_vec().unwrap();
    let largest = want.iter().fold(0f32, |m, b| m.max(b.abs()));
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * largest + 1e-4 * b.abs(),
            "{what}: element {i} is {a}, one device gives {b}"
        );
    }
}
