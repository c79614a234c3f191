//! Flat tensors joined end to end into one buffer: a DDP bucket, a ZeRO unit. burn's `cat`
//! allocates the buffer and writes each part with a launch of its own; the kernel here copies
//! up to [`MAX_PARTS_PER_LAUNCH`] parts in one launch, each element once. Unpacking needs no
//! kernel: `narrow` gives views into the buffer.
//!
//! [`pack`] runs the kernel on CUDA, where it saves launches, and `cat` everywhere else: on
//! lavapipe (wgpu on the CPU) the kernel is slower, because a CPU running the shader's units in
//! lock-step steps through every part's branch, taken or not. [`pack_with_kernel`] runs it on
//! any cubecl runtime the build has, for the tests and the bench.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::on_cube;

/// The most parts one launch copies (fewer where the device binds fewer buffers per kernel):
/// every part is a binding, and each count is a kernel of its own.
pub const MAX_PARTS_PER_LAUNCH: usize = 32;

/// `parts` (1-d, one dtype) joined end to end, as `Tensor::cat(parts, 0)` gives them: by the
/// kernel on CUDA, by `cat` elsewhere.
///
/// # Panics
/// If `parts` is empty or its dtypes differ.
pub fn pack<B: Backend>(parts: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    check(&parts);
    #[cfg(feature = "cuda")]
    if parts.len() > 1 && crate::cube::holds::<B, cubecl::cuda::CudaRuntime>() {
        return kernel::pack::<B, cubecl::cuda::CudaRuntime>(parts);
    }
    fallback_pack(parts)
}

/// [`pack`] by the kernel on every cubecl runtime this build has (`cuda`, `wgpu`), by `cat`
/// elsewhere.
///
/// # Panics
/// As [`pack`].
pub fn pack_with_kernel<B: Backend>(parts: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    check(&parts);
    if parts.len() > 1 {
        on_cube!(B, kernel::pack(parts));
    }
    fallback_pack(parts)
}

/// One or more parts, of one dtype.
fn check<B: Backend>(parts: &[Tensor<B, 1>]) {
    assert!(!parts.is_empty(), "pack: no tensors to join");
    let dtype = parts[0].dtype();
    if let Some((i, other)) = parts.iter().enumerate().find(|(_, p)| p.dtype() != dtype) {
        panic!(
            "pack: part {i} is {:?}, part 0 is {dtype:?}; a buffer holds one dtype",
            other.dtype()
        );
    }
}

/// [`pack`] in burn's tensor operations.
pub fn fallback_pack<B: Backend>(parts: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    match parts.len() {
        1 => parts.into_iter().next().expect("one part"),
        _ => Tensor::cat(parts, 0),
    }
}

#[cfg(feature = "cubecl")]
mod kernel {
    use burn::tensor::backend::Backend;
    use burn::tensor::{DType, Shape, Tensor};
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::frontend::Array;
    use cubecl::prelude::*;

    use super::{MAX_PARTS_PER_LAUNCH, fallback_pack};
    use crate::cube::{from_cube, into_cube};

    /// Copies `parts` into `output`, back to back from `start` (all counted in vectors). Part
    /// `p` gets cubes `firsts[p]..firsts[p + 1]`, in proportion to its length, so each cube
    /// copies from one part only and no cube idles.
    #[cube(launch, address_type = "dynamic")]
    fn pack_kernel<E: Numeric, N: Size>(
        parts: &Sequence<Array<Vector<E, N>>>,
        firsts: Sequence<usize>,
        output: &mut Array<Vector<E, N>>,
        start: usize,
        #[define(E)] _dtype: StorageType,
    ) {
        let cube = CUBE_POS_X as usize;
        let mut offset = start;
        #[unroll]
        for p in 0..parts.len() {
            let part = parts.index(p);
            let (first, end) = (firsts[p], firsts[p + 1]);
            if cube >= first && cube < end {
                let unit = (cube - first) * CUBE_DIM as usize + UNIT_POS as usize;
                let stride = (end - first) * CUBE_DIM as usize;
                for i in range_stepped(unit, part.len(), stride) {
                    output[offset + i] = part[i];
                }
            }
            offset += part.len();
        }
    }

    pub(super) fn pack<B: Backend, R: CubeRuntime>(parts: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
        let dtype = parts[0].dtype();
        if matches!(dtype, DType::QFloat(_)) {
            return fallback_pack(parts);
        }
        let parts: Vec<CubeTensor<R>> = parts
            .into_iter()
            .map(|p| into_contiguous(into_cube::<B, R, 1>(p)))
            .collect();
        let client = parts[0].client.clone();
        let total = parts.iter().map(|p| p.meta.shape()[0]).sum::<usize>();
        let output = empty_device_dtype(
            client.clone(),
            parts[0].device.clone(),
            Shape::new([total]),
            dtype,
        );
        // One binding stays for the output, one for the kernel's metadata.
        let bindings = client.properties().hardware.max_bindings as usize;
        let per_launch = MAX_PARTS_PER_LAUNCH.min(bindings.saturating_sub(2)).max(1);
        let mut start = 0;
        for batch in parts.chunks(per_launch) {
            let len = batch.iter().map(|p| p.meta.shape()[0]).sum::<usize>();
            if len > 0 {
                launch(&output, batch, start);
            }
            start += len;
        }
        from_cube::<B, R, 1>(output)
    }

    /// One launch for `batch`, written from element `start` of `output`: in the widest vectors
    /// that every part's length, `start` and every buffer's alignment allow, with cubes shared
    /// out over the parts by length.
    fn launch<R: CubeRuntime>(output: &CubeTensor<R>, batch: &[CubeTensor<R>], start: usize) {
        let client = &output.client;
        let size = output.dtype.size();
        let aligned = |t: &CubeTensor<R>, bytes: usize| {
            (t.handle.offset_start.unwrap_or(0) as usize).is_multiple_of(bytes)
        };
        let lengths: Vec<usize> = batch.iter().map(|p| p.meta.shape()[0]).collect();
        let vector = client
            .io_optimized_vector_sizes(size)
            .find(|&v| {
                start.is_multiple_of(v)
                    && aligned(output, v * size)
                    && lengths.iter().all(|l| l.is_multiple_of(v))
                    && batch.iter().all(|p| aligned(p, v * size))
            })
            .unwrap_or(1);
        let total = lengths.iter().sum::<usize>() / vector;
        let cube_dim = CubeDim::new(client, total);
        let per_cube = cube_dim.num_elems() as usize;
        // Past the device's most cubes, each unit copies several vectors (each part rounds its
        // cubes up, hence the margin of one per part).
        let most = client.properties().hardware.max_cube_count.0 as usize;
        let room = most.saturating_sub(lengths.len()).max(1);
        let per_unit = total.div_ceil(per_cube).div_ceil(room).max(1);
        let mut firsts = SequenceArg::<R, usize>::new();
        let mut cubes = 0;
        for len in &lengths {
            firsts.push(cubes);
            cubes += (len / vector).div_ceil(per_cube * per_unit);
        }
        firsts.push(cubes);
        pack_kernel::launch(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            cube_dim,
            output.required_address_type(),
            vector,
            batch.iter().map(|p| p.clone().into_array_arg()).collect(),
            firsts,
            output.clone().into_array_arg(),
            start / vector,
            output.dtype.into(),
        );
    }
}
