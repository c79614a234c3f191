//! What the kernel tests share.

#![allow(dead_code)]

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `len` values in [-1, 1), the same for the same seed.
pub fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// Each element of `actual` within `ulps` units of `expected`'s magnitude (floored at a
/// thousandth of the largest, where cancellation leaves a small result).
pub fn assert_close(actual: &[f32], expected: &[f32], ulps: u32, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    let largest = expected.iter().fold(0f32, |m, e| m.max(e.abs()));
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let allowed = ulps as f32 * f32::EPSILON * e.abs().max(largest * 1e-3);
        assert!(
            (a - e).abs() <= allowed,
            "{what}: element {i} is {a}, expected {e} (difference {}, allowed {allowed})",
            (a - e).abs()
        );
    }
}

/// Fails with what to install when `B` finds no device (the wgpu tests need a Vulkan driver).
pub fn require_device<B: Backend>() {
    let found = catch_unwind(AssertUnwindSafe(|| {
        Tensor::<B, 1>::zeros([1], &Default::default()).into_data()
    }));
    if found.is_err() {
        panic!(
            "{} found no device (its panic is above): the kernel tests need a GPU, or on a machine \
             without one Mesa's CPU Vulkan driver (Debian/Ubuntu: apt-get install mesa-vulkan-drivers)",
            std::any::type_name::<B>()
        );
    }
}
