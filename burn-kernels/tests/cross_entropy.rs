//! The cross-entropy row statistics: the fallback against a float64 reading on CPU, and the
//! kernel against the fallback on every cubecl runtime this build has.

mod common;

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use burn_kernels::cross_entropy::fallback_row_stats;
use common::values;

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

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_kernel_matches_fallback() {
    common::require_device::<burn::backend::Wgpu>();
    kernel_matches_fallback::<burn::backend::Wgpu>(1e-6);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_kernel_matches_fallback() {
    common::require_device::<burn::backend::Cuda>();
    kernel_matches_fallback::<burn::backend::Cuda>(1e-6);
}
