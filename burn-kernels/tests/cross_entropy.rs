//! The cross-entropy row statistics and their gradient: the fallbacks against a float64
//! reading on CPU, the kernels against the fallbacks on every cubecl runtime this build has, and
//! the hand-written backward on `Autodiff` against burn's autodiff of the same formula.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use burn_kernels::cross_entropy::{fallback_row_stats, fallback_row_stats_backward};
use burn_kernels::{KernelBackend, RowStats};
use common::{assert_close, values};

/// Logits `[n, part]` spread over about ±10, and targets: every third row's target held
/// elsewhere (-1), the others spread over the part.
fn inputs<B: Backend>(
    n: usize,
    part: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let logits: Vec<f32> = values(n * part, 7).iter().map(|v| v * 10.0).collect();
    let targets: Vec<i32> = (0..n)
        .map(|i| {
            if i % 3 == 2 {
                -1
            } else {
                ((i * 7919) % part) as i32
            }
        })
        .collect();
    let logits = Tensor::<B, 1>::from_floats(logits.as_slice(), device).reshape([n, part]);
    (logits, Tensor::from_ints(targets.as_slice(), device))
}

fn read<B: Backend>(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

#[test]
fn the_fallback_is_the_definition() {
    let (n, part) = (12, 50);
    let (logits, targets) = inputs::<Flex>(n, part, &Default::default());
    let x = logits.to_data().to_vec::<f32>().unwrap();
    let t = targets.to_data().to_vec::<i32>().unwrap();
    let stats = fallback_row_stats(logits, targets);
    let (max, sum, target) = (read(stats.max), read(stats.sum_exp), read(stats.target));
    for r in 0..n {
        let row = &x[r * part..(r + 1) * part];
        let m = row.iter().fold(f32::MIN, |a, &b| a.max(b));
        let s: f64 = row.iter().map(|&v| ((v - m) as f64).exp()).sum();
        assert_eq!(max[r], m, "row {r}'s maximum");
        assert!(
            (sum[r] as f64 - s).abs() <= 1e-5 * s,
            "row {r}'s sum {} against {s}",
            sum[r]
        );
        let expected = if t[r] < 0 { 0.0 } else { row[t[r] as usize] };
        assert_eq!(target[r], expected, "row {r}'s target logit");
    }
}

/// A part that is all -inf (masked columns) gives the floor `f32::MIN` as its maximum, a zero
/// sum and a zero gradient, not NaN: on the kernel and on the fallback.
fn minus_infinity_part<B: Backend>(
    stats: fn(Tensor<B, 2>, Tensor<B, 1, Int>) -> RowStats<B>,
    backward: Backward<B>,
) {
    let device = Default::default();
    let inf = f32::NEG_INFINITY;
    let logits =
        Tensor::<B, 1>::from_floats([inf, inf, inf, 1.0, 2.0, 3.0], &device).reshape([2, 3]);
    let targets = Tensor::<B, 1, Int>::from_ints([-1, 2], &device);
    let got = stats(logits.clone(), targets.clone());
    assert_eq!(
        read(got.max.clone())[0],
        f32::MIN,
        "the masked row's maximum"
    );
    assert_eq!(read(got.sum_exp)[0], 0.0, "the masked row's sum");
    let grad = backward(logits, got.max, targets, upstream::<B>(2, &device));
    let grad = grad.into_data().to_vec::<f32>().unwrap();
    assert_eq!(&grad[..3], &[0.0; 3], "the masked row's gradient");
    assert!(grad.iter().all(|g| g.is_finite()), "{grad:?}");
}

/// A `row_stats_backward`.
type Backward<B> = fn(Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 1, Int>, Tensor<B, 2>) -> Tensor<B, 2>;

#[test]
fn a_part_of_minus_infinity_sums_to_zero() {
    minus_infinity_part::<Flex>(fallback_row_stats, fallback_row_stats_backward);
}

/// The gradient `[n, 2]` flowing into the statistics: spread over ±1, different per row.
fn upstream<B: Backend>(n: usize, device: &B::Device) -> Tensor<B, 2> {
    Tensor::<B, 1>::from_floats(values(2 * n, 8).as_slice(), device).reshape([n, 2])
}

#[test]
fn the_backward_fallback_is_the_definition() {
    let (n, part) = (12, 50);
    let device = Default::default();
    let (logits, targets) = inputs::<Flex>(n, part, &device);
    let grad = upstream::<Flex>(n, &device);
    let max = logits.clone().max_dim(1).reshape([n]);
    let x = logits.to_data().to_vec::<f32>().unwrap();
    let m = read(max.clone());
    let t = targets.to_data().to_vec::<i32>().unwrap();
    let g = grad.to_data().to_vec::<f32>().unwrap();
    let got = fallback_row_stats_backward(logits, max, targets, grad);
    let got = got.into_data().to_vec::<f32>().unwrap();
    for r in 0..n {
        for j in 0..part {
            let mut want = g[2 * r] as f64 * ((x[r * part + j] - m[r]) as f64).exp();
            if t[r] == j as i32 {
                want += g[2 * r + 1] as f64;
            }
            let have = got[r * part + j] as f64;
            assert!(
                (have - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "row {r}, column {j}: {have} against {want}"
            );
        }
    }
}

/// The statistics of [`KernelBackend::cross_entropy_stats`] on `Autodiff<B>` and the logits'
/// gradient, against burn's autodiff of the plain formula (max detached, exp-sum, gather).
/// The maxima match exactly; the sums are added in different orders (within `sum_ulps`); the
/// gradients are computed by the same operations (within `ulps`).
fn autodiff_matches_formula<B: KernelBackend>(sum_ulps: u32, ulps: u32) {
    type A<B> = Autodiff<B>;
    let device = Default::default();
    for (n, part) in [(1, 1), (3, 7), (5, 256), (64, 1000), (2, 5003)] {
        let what = format!("{n} rows of {part}");
        let (logits, targets) = inputs::<B>(n, part, &device);
        let grad = upstream::<B>(n, &device);
        let leaf = || Tensor::<A<B>, 2>::from_inner(logits.clone()).require_grad();

        let fused = leaf();
        let stats = A::<B>::cross_entropy_stats(fused.clone(), Tensor::from_inner(targets.clone()));
        let weighted = stats.sums.clone() * Tensor::from_inner(grad.clone());
        let fused_grad = fused.grad(&weighted.sum().backward()).unwrap();

        let plain = leaf();
        let max = plain.clone().detach().max_dim(1);
        let sum_exp = (plain.clone() - max.clone()).exp().sum_dim(1);
        let held = targets.clone().greater_equal_elem(0).reshape([n, 1]);
        let column = targets.clone().clamp_min(0).reshape([n, 1]);
        let target = plain
            .clone()
            .gather(1, Tensor::from_inner(column))
            .mask_fill(Tensor::from_inner(held.bool_not()), 0.0);
        let sums = Tensor::cat(vec![sum_exp, target], 1);
        let weighted = sums.clone() * Tensor::from_inner(grad.clone());
        let plain_grad = plain.grad(&weighted.sum().backward()).unwrap();

        assert_eq!(
            read(stats.max.inner()),
            read(max.inner().reshape([n])),
            "maxima of {what}"
        );
        let flat = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().unwrap();
        let (got, want) = (flat(stats.sums.inner()), flat(sums.inner()));
        assert_close(&got, &want, sum_ulps, &format!("sums of {what}"));
        assert_close(
            &flat(fused_grad),
            &flat(plain_grad),
            ulps,
            &format!("logits' gradient of {what}"),
        );
    }
}

#[test]
fn the_backward_on_autodiff_is_autodiffs_of_the_formula() {
    autodiff_matches_formula::<Flex>(0, 0);
}

/// Each row's sum of exponentials in float64, from the logits `[n, part]` (row-major).
#[cfg(feature = "cubecl")]
fn exact_sums(logits: &[f32], part: usize) -> Vec<f64> {
    logits
        .chunks(part)
        .map(|row| {
            let m = row.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
            row.iter().map(|&v| (v as f64 - m).exp()).sum()
        })
        .collect()
}

/// The largest relative error of `sums` against `exact`.
#[cfg(feature = "cubecl")]
fn worst(sums: &[f32], exact: &[f64]) -> f64 {
    sums.iter()
        .zip(exact)
        .map(|(&s, &e)| ((s as f64 - e) / e).abs())
        .fold(0.0, f64::max)
}

/// The kernel on `B` (a cubecl backend) against the fallback on the same device: maxima and
/// target logits exactly; sums, which the two add in different orders, against the float64
/// sum: the kernel's within `tolerance`, the fallback's (burn's sum) within 1e-5. Measured on
/// lavapipe: the kernel's tree of partial sums 1.4e-7 at 5003 columns, burn's 4.5e-6.
#[cfg(feature = "cubecl")]
fn kernel_matches_fallback<B: Backend>(tolerance: f64) {
    assert!(burn_kernels::has_kernels::<B>());
    let device = Default::default();
    for (n, part) in [(1, 1), (3, 7), (5, 256), (64, 1000), (2, 5003)] {
        let (logits, targets) = inputs::<B>(n, part, &device);
        let exact = exact_sums(&logits.to_data().to_vec::<f32>().unwrap(), part);
        let kernel = burn_kernels::row_stats(logits.clone(), targets.clone());
        let fallback = fallback_row_stats(logits, targets);
        let what = format!("{n} rows of {part}");
        assert_eq!(read(kernel.max), read(fallback.max), "maxima of {what}");
        assert_eq!(
            read(kernel.target),
            read(fallback.target),
            "targets of {what}"
        );
        let (kernel, fallback) = (
            worst(&read(kernel.sum_exp), &exact),
            worst(&read(fallback.sum_exp), &exact),
        );
        eprintln!("{what}: kernel {kernel:.1e}, fallback {fallback:.1e}");
        assert!(
            kernel <= tolerance,
            "the kernel's sums of {what} are off by {kernel:e}"
        );
        assert!(
            fallback <= 1e-5,
            "the fallback's sums of {what} are off by {fallback:e}"
        );
    }
}

/// The backward kernel on `B` against the fallback on the same device, within `ulps` (both
/// compute each element by the same operations; a compiler may fuse the multiply-add).
#[cfg(feature = "cubecl")]
fn backward_kernel_matches_fallback<B: Backend>(ulps: u32) {
    assert!(burn_kernels::has_kernels::<B>());
    let device = Default::default();
    for (n, part) in [(1, 1), (3, 7), (64, 1000), (2, 5003)] {
        let (logits, targets) = inputs::<B>(n, part, &device);
        let grad = upstream::<B>(n, &device);
        let max = logits.clone().max_dim(1).reshape([n]);
        let run = |backward: fn(_, _, _, _) -> Tensor<B, 2>| {
            let out = backward(logits.clone(), max.clone(), targets.clone(), grad.clone());
            out.into_data().to_vec::<f32>().unwrap()
        };
        let kernel = run(burn_kernels::row_stats_backward);
        let fallback = run(fallback_row_stats_backward);
        assert_close(&kernel, &fallback, ulps, &format!("{n} rows of {part}"));
    }
}

macro_rules! on_runtime {
    ($name:ident, $feature:literal, $backend:ty, $backward_ulps:literal) => {
        #[cfg(feature = $feature)]
        mod $name {
            type B = $backend;

            #[test]
            fn kernel_matches_fallback() {
                super::common::require_device::<B>();
                super::kernel_matches_fallback::<B>(1e-6);
            }

            #[test]
            fn backward_kernel_matches_fallback() {
                super::common::require_device::<B>();
                super::backward_kernel_matches_fallback::<B>($backward_ulps);
            }

            #[test]
            fn a_part_of_minus_infinity_sums_to_zero() {
                super::common::require_device::<B>();
                super::minus_infinity_part::<B>(
                    burn_kernels::row_stats,
                    burn_kernels::row_stats_backward,
                );
            }

            #[test]
            fn the_backward_on_autodiff_is_autodiffs_of_the_formula() {
                super::common::require_device::<B>();
                super::autodiff_matches_formula::<B>(64, 4);
            }
        }
    };
}

// The backward kernel and its fallback do the same operations; a compiler may fuse the
// multiply-add (lavapipe does not: equal bits, measured), NVRTC does.
on_runtime!(wgpu, "wgpu", burn::backend::Wgpu, 2);
on_runtime!(cuda, "cuda", burn::backend::Cuda, 4);
