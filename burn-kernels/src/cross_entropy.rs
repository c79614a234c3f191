//! The per-row statistics a vocabulary-parallel cross-entropy needs from one rank's logits:
//! the row's maximum, its sum of exponentials relative to that maximum, and the target's logit
//! when this rank holds the target's column. On a cubecl device one kernel reads the logits once
//! (an online softmax: the running sum is rescaled whenever the maximum grows), where plain burn
//! reads them three times (max, exp-sum, gather). Elsewhere the same three come from burn's
//! tensor operations. [`row_stats_backward`] is their gradient, in one pass over the logits on a
//! cubecl device.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, IndexingUpdateOp, Int, Tensor};

use crate::on_cube;

/// One rank's per-row statistics of logits `[n, part]`, each `[n]`, fp32.
#[derive(Debug, Clone)]
pub struct RowStats<B: Backend> {
    /// The row's largest logit, or `f32::MIN` where all are -inf (its sum is then 0).
    pub max: Tensor<B, 1>,
    /// `sum_j exp(logit_j - max)` over the row.
    pub sum_exp: Tensor<B, 1>,
    /// The logit of the row's target column, or 0 where this rank does not hold it.
    pub target: Tensor<B, 1>,
}

/// The statistics of `logits` (`[n, part]`, fp32) with `targets` the target's column in this
/// part (`0..part`), or -1 where the target lies in another rank's part.
pub fn row_stats<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> RowStats<B> {
    let [n, part] = logits.dims();
    assert_eq!(targets.dims()[0], n, "one target per row of logits");
    assert_eq!(
        logits.dtype(),
        DType::F32,
        "the statistics are taken in fp32"
    );
    if part > 0 && targets.dtype() == DType::I32 {
        on_cube!(B, kernel::row_stats(logits, targets));
    }
    fallback_row_stats(logits, targets)
}

/// [`row_stats`] in burn's tensor operations.
pub fn fallback_row_stats<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> RowStats<B> {
    let n = logits.dims()[0];
    // The kernel's floor: a part that is all -inf (masked columns) sums to 0, not NaN.
    let max = logits.clone().max_dim(1).clamp_min(f32::MIN);
    let sum_exp = (logits.clone() - max.clone()).exp().sum_dim(1);
    let (elsewhere, column) = target_columns(targets);
    let target = logits.gather(1, column).mask_fill(elsewhere, 0.0);
    RowStats {
        max: max.reshape([n]),
        sum_exp: sum_exp.reshape([n]),
        target: target.reshape([n]),
    }
}

/// `[n, 1]`: where another rank holds the target (`targets` -1), and the target's column (0
/// there, so that a gather or scatter stays in range).
fn target_columns<B: Backend>(
    targets: Tensor<B, 1, Int>,
) -> (Tensor<B, 2, Bool>, Tensor<B, 2, Int>) {
    let n = targets.dims()[0];
    let elsewhere = targets.clone().lower_elem(0).reshape([n, 1]);
    (elsewhere, targets.clamp_min(0).reshape([n, 1]))
}

/// The gradient of `logits` (`[n, part]`) from `grad` (`[n, 2]`), the gradients of the row
/// statistics' `sum_exp` (column 0) and `target` (column 1), with the row maximum `max` held
/// constant: `grad[r, 0] * exp(logits[r, j] - max[r])`, plus `grad[r, 1]` in the target's column
/// where this part holds it (`targets` as in [`row_stats`]).
pub fn row_stats_backward<B: Backend>(
    logits: Tensor<B, 2>,
    max: Tensor<B, 1>,
    targets: Tensor<B, 1, Int>,
    grad: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let [n, part] = logits.dims();
    assert_eq!(max.dims()[0], n, "one maximum per row of logits");
    assert_eq!(targets.dims()[0], n, "one target per row of logits");
    assert_eq!(grad.dims(), [n, 2], "a (sum_exp, target) gradient per row");
    let fp32 = [logits.dtype(), max.dtype(), grad.dtype()] == [DType::F32; 3];
    assert!(fp32, "the statistics' gradient is taken in fp32");
    if n * part > 0 && targets.dtype() == DType::I32 {
        on_cube!(B, kernel::row_stats_backward(logits, max, targets, grad));
    }
    fallback_row_stats_backward(logits, max, targets, grad)
}

/// [`row_stats_backward`] in burn's tensor operations.
pub fn fallback_row_stats_backward<B: Backend>(
    logits: Tensor<B, 2>,
    max: Tensor<B, 1>,
    targets: Tensor<B, 1, Int>,
    grad: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let n = logits.dims()[0];
    let sum_exp_grad = grad.clone().narrow(1, 0, 1);
    let from_sum = (logits - max.reshape([n, 1])).exp() * sum_exp_grad;
    let (elsewhere, column) = target_columns(targets);
    let target_grad = grad.narrow(1, 1, 1).mask_fill(elsewhere, 0.0);
    from_sum.scatter(1, column, target_grad, IndexingUpdateOp::Add)
}

#[cfg(feature = "cubecl")]
mod kernel {
    use burn::tensor::backend::Backend;
    use burn::tensor::{Int, Tensor};
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{calculate_cube_count_elemwise, frontend::Array};

    use super::RowStats;
    use crate::cube::{from_cube, int_into_cube, into_cube};

    /// Units per row: each strides over the row, then the cube combines their partial results.
    const UNITS: usize = 256;

    /// Combines two partial (max, sum relative to max) pairs.
    #[cube]
    fn combine(m1: f32, s1: f32, m2: f32, s2: f32) -> (f32, f32) {
        let m = f32::max(m1, m2);
        (m, s1 * f32::exp(m1 - m) + s2 * f32::exp(m2 - m))
    }

    #[cube(launch, address_type = "dynamic")]
    fn row_stats_kernel(
        logits: &Array<f32>,
        targets: &Array<i32>,
        max: &mut Array<f32>,
        sum_exp: &mut Array<f32>,
        target: &mut Array<f32>,
        rows: usize,
        width: usize,
    ) {
        let row = CUBE_POS;
        if row >= rows {
            terminate!();
        }
        let unit = UNIT_POS as usize;
        let start = row * width;
        let wanted = targets[row];
        // A finite floor, not -inf: two empty partials must not combine into inf - inf.
        let mut m = f32::new(-3.4028235e38);
        let mut s = f32::new(0.0);
        for j in range_stepped(unit, width, UNITS) {
            let x = logits[start + j];
            if x > m {
                s = s * f32::exp(m - x) + f32::new(1.0);
                m = x;
            } else {
                s += f32::exp(x - m);
            }
            if wanted >= 0 && j == wanted as usize {
                target[row] = x;
            }
        }
        if wanted < 0 && unit == 0 {
            target[row] = f32::new(0.0);
        }
        let mut maxes = SharedMemory::<f32>::new(UNITS);
        let mut sums = SharedMemory::<f32>::new(UNITS);
        maxes[unit] = m;
        sums[unit] = s;
        sync_cube();
        // CUBE_DIM is UNITS, read at run time so the loop is not unrolled.
        let mut stride = CUBE_DIM as usize / 2;
        while stride > 0 {
            if unit < stride {
                let (m, s) = combine(
                    maxes[unit],
                    sums[unit],
                    maxes[unit + stride],
                    sums[unit + stride],
                );
                maxes[unit] = m;
                sums[unit] = s;
            }
            sync_cube();
            stride /= 2;
        }
        if unit == 0 {
            max[row] = maxes[0];
            sum_exp[row] = sums[0];
        }
    }

    /// One unit per element of the logits' gradient.
    #[cube(launch, address_type = "dynamic")]
    fn row_stats_backward_kernel(
        logits: &Array<f32>,
        max: &Array<f32>,
        targets: &Array<i32>,
        grad: &Array<f32>,
        output: &mut Array<f32>,
        width: usize,
    ) {
        let i = ABSOLUTE_POS;
        if i >= output.len() {
            terminate!();
        }
        let row = i / width;
        let column = i % width;
        let mut value = grad[2 * row] * f32::exp(logits[i] - max[row]);
        let wanted = targets[row];
        if wanted >= 0 && column == wanted as usize {
            value += grad[2 * row + 1];
        }
        output[i] = value;
    }

    pub(super) fn row_stats_backward<B: Backend, R: CubeRuntime>(
        logits: Tensor<B, 2>,
        max: Tensor<B, 1>,
        targets: Tensor<B, 1, Int>,
        grad: Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let [n, width] = logits.dims();
        let logits = into_contiguous(into_cube::<B, R, 2>(logits));
        let max = into_contiguous(into_cube::<B, R, 1>(max));
        let targets = into_contiguous(int_into_cube::<B, R, 1>(targets));
        let grad = into_contiguous(into_cube::<B, R, 2>(grad));
        let client = logits.client.clone();
        let output = empty_device_dtype(
            client.clone(),
            logits.device.clone(),
            [n, width].into(),
            burn::tensor::DType::F32,
        );
        let len = n * width;
        let cube_dim = CubeDim::new(&client, len);
        let cube_count = calculate_cube_count_elemwise(&client, len, cube_dim);
        let address = [&logits, &output]
            .into_iter()
            .map(|t| t.required_address_type())
            .max()
            .expect("two tensors");
        let array = |t: &CubeTensor<R>| t.clone().into_array_arg();
        row_stats_backward_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            address,
            array(&logits),
            array(&max),
            array(&targets),
            array(&grad),
            array(&output),
            width,
        );
        from_cube(output)
    }

    pub(super) fn row_stats<B: Backend, R: CubeRuntime>(
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> RowStats<B> {
        let [n, width] = logits.dims();
        let logits = into_contiguous(into_cube::<B, R, 2>(logits));
        let targets = into_contiguous(int_into_cube::<B, R, 1>(targets));
        let client = logits.client.clone();
        let out = || {
            empty_device_dtype(
                client.clone(),
                logits.device.clone(),
                [n].into(),
                burn::tensor::DType::F32,
            )
        };
        let (max, sum_exp, target) = (out(), out(), out());
        let cube_count = calculate_cube_count_elemwise(&client, n, CubeDim::new_1d(1));
        let array = |t: &CubeTensor<R>| t.clone().into_array_arg();
        let address = logits.required_address_type();
        row_stats_kernel::launch(
            &client,
            cube_count,
            CubeDim::new_1d(UNITS as u32),
            address,
            array(&logits),
            array(&targets),
            array(&max),
            array(&sum_exp),
            array(&target),
            n,
            width,
        );
        RowStats {
            max: from_cube(max),
            sum_exp: from_cube(sum_exp),
            target: from_cube(target),
        }
    }
}
