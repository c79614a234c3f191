//! The pack kernel against burn's `cat`, bit for bit, on every cubecl runtime this build has
//! (feature `wgpu`: lavapipe in CI; `cuda`: the GPU validation script); the fallback and the
//! errors on CPU.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_kernels::pack::{MAX_PARTS_PER_LAUNCH, fallback_pack, pack, pack_with_kernel};
use common::values;

/// Parts of the given lengths, each but the empty ones a view into a larger tensor, so it
/// starts at an offset in its buffer: burn keeps a narrowed tensor as a view only when both its
/// ends lie on the device's buffer alignment, hence the 1024 elements on each side.
fn parts<B: Backend>(lengths: &[usize], dtype: DType, device: &B::Device) -> Vec<Tensor<B, 1>> {
    lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let whole =
                Tensor::<B, 1>::from_floats(values(len + 2048, i as u64).as_slice(), device);
            match len {
                // burn refuses a zero-length narrow.
                0 => Tensor::<B, 1>::zeros([0], device).cast(dtype),
                _ => whole.cast(dtype).narrow(0, 1024, len),
            }
        })
        .collect()
}

fn bytes<B: Backend>(tensor: Tensor<B, 1>) -> TensorData {
    tensor.into_data()
}

#[test]
fn the_fallback_is_cat_and_one_part_is_itself() {
    let device = Default::default();
    let ps = parts::<Flex>(&[3, 0, 5], DType::F32, &device);
    let expected = bytes(Tensor::cat(ps.clone(), 0));
    assert_eq!(bytes(pack(ps.clone())), expected);
    assert_eq!(bytes(pack_with_kernel(ps.clone())), expected);
    assert_eq!(bytes(fallback_pack(ps)), expected);
    let one = parts::<Flex>(&[4], DType::F32, &device);
    assert_eq!(bytes(pack(one.clone())), bytes(one[0].clone()));
}

#[test]
fn no_parts_or_mixed_dtypes_are_refused() {
    let message = |f: Box<dyn FnOnce()>| {
        let err = catch_unwind(AssertUnwindSafe(f)).expect_err("refused");
        err.downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    };
    let empty = message(Box::new(|| {
        pack::<Flex>(vec![]);
    }));
    assert!(empty.contains("no tensors"), "{empty}");
    let device = Default::default();
    let mut mixed = parts::<Flex>(&[2, 2], DType::F32, &device);
    mixed[1] = mixed[1].clone().cast(DType::F16);
    let mixed = message(Box::new(move || {
        pack(mixed);
    }));
    assert!(mixed.contains("part 1 is F16"), "{mixed}");
}

/// The kernel on `B` (a cubecl backend) against `cat` on the same device, bit for bit: for
/// each dtype, part counts that fill several launches, empty and one-element parts, parts
/// that are views or strided, and lengths that do and do not allow vectors. `pack` itself
/// (the kernel on CUDA, `cat` elsewhere) agrees too.
#[cfg(feature = "cubecl")]
fn kernel_matches_cat<B: Backend>(dtypes: &[DType]) {
    assert!(
        burn_kernels::has_kernels::<B>(),
        "a cubecl backend runs the kernel"
    );
    let device = Default::default();
    let many: Vec<usize> = (0..2 * MAX_PARTS_PER_LAUNCH + 3)
        .map(|i| (i * 37) % 101)
        .collect();
    // Lengths that allow vectors, in more parts than one launch takes.
    let whole_vectors: Vec<usize> = (0..MAX_PARTS_PER_LAUNCH + 8)
        .map(|i| 4 * (1 + i % 7))
        .collect();
    let cases: [&[usize]; 7] = [
        &[1, 1],
        &[0, 7, 0],
        &[1000, 3, 70_001],
        &[0, 0],
        &[64, 1024, 4096],
        &many,
        &whole_vectors,
    ];
    for &dtype in dtypes {
        for lengths in cases {
            let ps = parts::<B>(lengths, dtype, &device);
            // The kernel first: a buffer `cat` just freed could hold the right answer already.
            let actual = bytes(pack_with_kernel(ps.clone()));
            let expected = bytes(Tensor::cat(ps.clone(), 0));
            let what = format!("{dtype:?}, {} parts", lengths.len());
            assert_eq!(actual, expected, "{what}");
            assert_eq!(bytes(pack(ps)), expected, "{what}, pack");
        }
        // One element seen five times: a view whose stride is 0.
        let one = Tensor::<B, 1>::from_floats([1.5], &device);
        let strided = one.cast(dtype).expand([5]);
        let head = parts::<B>(&[4], dtype, &device).remove(0);
        let ps = vec![head, strided];
        let actual = bytes(pack_with_kernel(ps.clone()));
        let expected = bytes(Tensor::cat(ps, 0));
        assert_eq!(actual, expected, "{dtype:?}, a strided part");
    }
}

/// The parts stay as they were: the kernel only reads them.
#[cfg(feature = "cubecl")]
fn kernel_leaves_its_parts_alone<B: Backend>() {
    let device = Default::default();
    let ps = parts::<B>(&[5, 9], DType::F32, &device);
    let before: Vec<_> = ps.iter().map(|p| p.to_data()).collect();
    let packed = pack_with_kernel(ps.clone());
    let _ = packed.add_scalar(1.0).into_data();
    let after: Vec<_> = ps.iter().map(|p| p.to_data()).collect();
    assert_eq!(after, before);
}

macro_rules! on_runtime {
    ($name:ident, $feature:literal, $backend:ty, $dtypes:expr) => {
        #[cfg(feature = $feature)]
        mod $name {
            #[test]
            fn kernel_matches_cat() {
                super::common::require_device::<$backend>();
                super::kernel_matches_cat::<$backend>(&$dtypes);
            }

            #[test]
            fn kernel_leaves_its_parts_alone() {
                super::common::require_device::<$backend>();
                super::kernel_leaves_its_parts_alone::<$backend>();
            }
        }
    };
}

// lavapipe has no 16-bit floats; CUDA copies them as 16-bit words.
on_runtime!(
    wgpu,
    "wgpu",
    burn::backend::Wgpu,
    [burn::tensor::DType::F32]
);
on_runtime!(
    cuda,
    "cuda",
    burn::backend::Cuda,
    [
        burn::tensor::DType::F32,
        burn::tensor::DType::F16,
        burn::tensor::DType::BF16
    ]
);
