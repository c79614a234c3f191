//! The fused AdamW against burn's AdamW: the fallback's formula on CPU bit for bit, and the
//! kernel on every cubecl runtime this build has (feature `wgpu`: lavapipe in CI; `cuda`: the
//! GPU validation script).

mod common;

use burn::backend::Flex;
use burn::optim::{AdamW, AdamWConfig, AdamWState, SimpleOptimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_kernels::FusedAdamW;
use burn_kernels::adamw::fallback_step;
use common::values;

fn config() -> AdamWConfig {
    AdamWConfig::new()
        .with_beta_1(0.85)
        .with_beta_2(0.98)
        .with_epsilon(1e-6)
        .with_weight_decay(0.1)
}

/// `steps` steps of a `len`-element shard with fresh gradients, by `step`; the weights and
/// moments after each.
fn train<B: Backend>(
    len: usize,
    steps: usize,
    device: &B::Device,
    mut step: impl FnMut(
        f64,
        Tensor<B, 1>,
        Tensor<B, 1>,
        Option<AdamWState<B, 1>>,
    ) -> (Tensor<B, 1>, AdamWState<B, 1>),
) -> Vec<[Vec<f32>; 3]> {
    let mut weights = Tensor::from_floats(values(len, 1).as_slice(), device);
    let mut state = None;
    (0..steps)
        .map(|s| {
            let grad = Tensor::from_floats(values(len, 10 + s as u64).as_slice(), device);
            let lr = 1e-2 / (s + 1) as f64;
            let (updated, next) = step(lr, weights.clone(), grad, state.take());
            weights = updated;
            let read = |t: &Tensor<B, 1>| t.to_data().to_vec::<f32>().unwrap();
            let out = [
                read(&weights),
                read(&next.momentum.moment_1),
                read(&next.momentum.moment_2),
            ];
            state = Some(next);
            out
        })
        .collect()
}

/// A step of burn's own AdamW.
fn burn_step<B: Backend>(
    adamw: &AdamW,
    lr: f64,
    weights: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    state: Option<AdamWState<B, 1>>,
) -> (Tensor<B, 1>, AdamWState<B, 1>) {
    let (weights, state) = adamw.step(lr, weights, grad, state);
    (weights, state.expect("AdamW returns its state"))
}

#[test]
fn the_kernels_formula_is_burns_adamw_bit_for_bit() {
    let device = Default::default();
    let adamw = config().build();
    let expected = train::<Flex>(257, 4, &device, |lr, w, g, s| {
        burn_step(&adamw, lr, w, g, s)
    });
    let fused = FusedAdamW::new(&config());
    assert!(!fused.is_fused::<Flex>(), "Flex has no kernel");
    let actual = train::<Flex>(257, 4, &device, |lr, w, g, s| {
        // The fallback, fed the constants the kernel would get.
        let time = s.as_ref().map_or(0, |s| s.momentum.time) + 1;
        let constants = fused.constants(lr, time).expect("plain AdamW is fused");
        let (m, v) = s.map_or_else(
            || (w.zeros_like(), w.zeros_like()),
            |s| (s.momentum.moment_1, s.momentum.moment_2),
        );
        let [w, m, v] = fallback_step(constants, w, g, m, v);
        let momentum = burn::optim::AdaptiveMomentumState::new(time, m, v);
        (w, AdamWState::new(momentum))
    });
    assert_eq!(actual, expected);
}

#[test]
fn amsgrad_and_cautious_decay_take_burns_adamw() {
    for config in [
        config().with_amsgrad(true),
        config().with_cautious_weight_decay(true),
    ] {
        let device = Default::default();
        let adamw = config.build();
        let expected = train::<Flex>(65, 3, &device, |lr, w, g, s| burn_step(&adamw, lr, w, g, s));
        let fused = FusedAdamW::new(&config);
        let actual = train::<Flex>(65, 3, &device, |lr, w, g, s| fused.step(lr, w, g, s));
        assert_eq!(actual, expected);
    }
}

/// The kernel on `B` (a cubecl backend) against burn's AdamW on the same device, each element
/// within `ulps`.
#[cfg(feature = "cubecl")]
fn kernel_matches_burn<B: Backend>(ulps: u32) {
    let device = Default::default();
    let fused = FusedAdamW::new(&config());
    assert!(fused.is_fused::<B>(), "a cubecl backend runs the kernel");
    let adamw = config().build();
    for len in [0, 1, 1000, 70_001] {
        let expected = train::<B>(len, 5, &device, |lr, w, g, s| {
            burn_step(&adamw, lr, w, g, s)
        });
        let actual = train::<B>(len, 5, &device, |lr, w, g, s| fused.step(lr, w, g, s));
        for (step, (a, e)) in actual.iter().zip(&expected).enumerate() {
            for (what, a, e) in [
                ("weights", &a[0], &e[0]),
                ("first moment", &a[1], &e[1]),
                ("second moment", &a[2], &e[2]),
            ] {
                common::assert_close(
                    a,
                    e,
                    ulps,
                    &format!("{what} after step {} of {len}", step + 1),
                );
            }
        }
    }
}

/// A state the caller still holds is not overwritten by the in-place kernel.
#[cfg(feature = "cubecl")]
fn kernel_leaves_a_held_state_alone<B: Backend>() {
    let device = Default::default();
    let fused = FusedAdamW::new(&config());
    let weights = Tensor::<B, 1>::from_floats(values(300, 1).as_slice(), &device);
    let grad = || Tensor::<B, 1>::from_floats(values(300, 2).as_slice(), &device);
    let (weights, state) = fused.step(1e-3, weights, grad(), None);
    let held_weights = weights.to_data();
    let held_moment = state.momentum.moment_1.to_data();
    let kept = (weights.clone(), state.clone());
    let _ = fused.step(1e-3, weights, grad(), Some(state));
    assert_eq!(kept.0.to_data(), held_weights);
    assert_eq!(kept.1.momentum.moment_1.to_data(), held_moment);
}

macro_rules! on_runtime {
    ($name:ident, $feature:literal, $backend:ty, $ulps:literal) => {
        #[cfg(feature = $feature)]
        mod $name {
            #[test]
            fn kernel_matches_burns_adamw() {
                super::common::require_device::<$backend>();
                super::kernel_matches_burn::<$backend>($ulps);
            }

            #[test]
            fn kernel_leaves_a_held_state_alone() {
                super::common::require_device::<$backend>();
                super::kernel_leaves_a_held_state_alone::<$backend>();
            }
        }
    };
}

// Bit for bit on lavapipe (measured); NVRTC contracts multiply-adds into FMAs, burn's separate
// kernels cannot, so CUDA may differ in the last bits.
on_runtime!(wgpu, "wgpu", burn::backend::Wgpu, 0);
on_runtime!(cuda, "cuda", burn::backend::Cuda, 4);
