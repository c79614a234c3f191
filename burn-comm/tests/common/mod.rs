//! Helpers shared by the burn-comm integration tests.
#![allow(dead_code)]

use std::time::Duration;

use burn::backend::Flex;
use burn::tensor::{DType, Tensor, TensorData};
use burn_comm::{
    CommError, Communicator, LaunchConfig, RankContext, RankError, ReduceOp, launch_with,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub type B = Flex;

/// Runs `f` on `world` ranks and unwraps every rank's result.
pub fn run<T: Send>(
    world: usize,
    f: impl Fn(RankContext) -> Result<T, burn_comm::CommError> + Sync,
) -> Vec<T> {
    launch_with(
        LaunchConfig::new(world).with_timeout(Duration::from_secs(60)),
        f,
    )
    .into_iter()
    .map(|r| r.unwrap_or_else(|e: RankError<_>| panic!("{e}")))
    .collect()
}

/// A random tensor in [-1, 1) of `dtype`, the same for the same seed.
pub fn random<const D: usize>(seed: u64, shape: [usize; D], dtype: DType) -> Tensor<B, D> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Tensor::from_data(data, (&Default::default(), dtype))
}

/// Like [`random`], but each value scaled by 2^k for a random k in -12..=12: sums of such
/// values round, so a reduction's order shows in their bits (values in [-1, 1) lie on one
/// fixed-point grid and mostly sum exactly in any order). Sums of 15 ranks stay within f16.
pub fn random_magnitudes<const D: usize>(
    seed: u64,
    shape: [usize; D],
    dtype: DType,
) -> Tensor<B, D> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    // Drawn in f64, so that f64 values have every bit of their mantissa too.
    let values: Vec<f64> = (0..n)
        .map(|_| rng.random_range(-1.0..1.0) * 2f64.powi(rng.random_range(-12..=12)))
        .collect();
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Tensor::from_data(data, (&Default::default(), dtype))
}

/// A random shape with dimensions in 1..=max, where `dim` is a multiple of `multiple`.
pub fn random_shape<const D: usize>(
    rng: &mut StdRng,
    max: usize,
    dim: usize,
    multiple: usize,
) -> [usize; D] {
    let mut shape = [0; D];
    for (d, s) in shape.iter_mut().enumerate() {
        *s = rng.random_range(1..=max);
        if d == dim {
            *s *= multiple;
        }
    }
    shape
}

/// Asserts two tensors are equal bit for bit.
pub fn assert_bits_eq(actual: &TensorData, expected: &TensorData, what: &str) {
    assert_eq!(actual.shape, expected.shape, "{what}: shape");
    assert_eq!(actual.dtype, expected.dtype, "{what}: dtype");
    assert!(
        actual.as_bytes() == expected.as_bytes(),
        "{what}: values differ\n actual: {actual}\n expected: {expected}"
    );
}

pub const WORLD_SIZES: [usize; 5] = [1, 2, 3, 4, 8];

/// The sum of every rank's `x`, with rank 0's all-reduce started asynchronously before it meets
/// the others on a second group, which they do before they join the all-reduce: an async call
/// that waited for its peers before returning would leave both sides waiting until the
/// timeout.
pub fn sum_joined_after_an_async_start<const D: usize>(
    comm: &Communicator,
    x: Tensor<B, D>,
) -> Result<Tensor<B, D>, CommError> {
    let side = comm.split("side", 0)?;
    if comm.rank() == 0 {
        let pending = comm.all_reduce_async(x, ReduceOp::Sum);
        side.barrier()?;
        pending.wait()
    } else {
        side.barrier()?;
        comm.all_reduce(x, ReduceOp::Sum)
    }
}
