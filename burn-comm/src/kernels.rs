//! Host-memory kernels of the local transport: reductions in a fixed rank order and strided
//! copies between row-major buffers. Callers guarantee that the regions they pass are valid and
//! that no other thread writes them at the same time.

use std::ops::Range;

use burn::tensor::{DType, bf16, f16};

use crate::ReduceOp;

/// Elements reduced per block: the running sum stays in L1 while every source is added in.
const BLOCK: usize = 1024;

/// An element type the local transport can reduce.
trait Reducible: Copy + 'static {
    /// The type the running value is kept in (f32 for the half-precision types).
    type Acc: Copy + Default;
    const FLOAT: bool;
    fn load(self) -> Self::Acc;
    fn store(acc: Self::Acc) -> Self;
    fn combine(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn divide(acc: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! reducible_float {
    ($t:ty, $acc:ty, $load:expr, $store:expr) => {
        impl Reducible for $t {
            type Acc = $acc;
            const FLOAT: bool = true;
            #[inline(always)]
            fn load(self) -> $acc {
                $load(self)
            }
            #[inline(always)]
            fn store(acc: $acc) -> Self {
                $store(acc)
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: $acc, b: $acc) -> $acc {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    // NaN propagates, as in torch.maximum.
                    ReduceOp::Max => {
                        if b > a || b.is_nan() {
                            b
                        } else {
                            a
                        }
                    }
                    ReduceOp::Min => {
                        if b < a || b.is_nan() {
                            b
                        } else {
                            a
                        }
                    }
                }
            }
            #[inline(always)]
            fn divide(acc: $acc, n: usize) -> $acc {
                acc / n as $acc
            }
        }
    };
}

reducible_float!(f32, f32, |x| x, |x| x);
reducible_float!(f64, f64, |x| x, |x| x);
reducible_float!(f16, f32, f16::to_f32, f16::from_f32);
reducible_float!(bf16, f32, bf16::to_f32, bf16::from_f32);

macro_rules! reducible_int {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            type Acc = $t;
            const FLOAT: bool = false;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(acc: $t) -> Self {
                acc
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
            #[inline(always)]
            fn divide(acc: $t, _n: usize) -> $t {
                acc
            }
        }
    )*};
}

reducible_int!(i64, i32, i16, i8, u64, u32, u16, u8);

/// Runs `$body` with `$t` bound to the element type of `$dtype`, or evaluates `$other`.
macro_rules! with_reducible {
    ($dtype:expr, $t:ident => $body:expr, $other:expr) => {
        match $dtype {
            DType::F32 | DType::Flex32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I16 => {
                type $t = i16;
                $body
            }
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::U64 => {
                type $t = u64;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::U16 => {
                type $t = u16;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            _ => $other,
        }
    };
}

/// Why `op` cannot reduce `dtype`, if it cannot.
pub(crate) fn check_reducible(dtype: DType, op: ReduceOp) -> Result<(), String> {
    let float = with_reducible!(dtype, T => T::FLOAT, {
        return Err(format!("{dtype:?} tensors cannot be reduced; send a float or integer tensor"));
    });
    if op == ReduceOp::Avg && !float {
        return Err(format!(
            "avg needs a floating-point tensor, got {dtype:?}; reduce with sum and divide yourself"
        ));
    }
    Ok(())
}

/// Reduces `len` elements from every source, in source order, and writes the result to every
/// destination. A destination may be one of the sources: each block is read completely before
/// it is written.
///
/// # Safety
/// Every pointer must be valid for `len` elements of `dtype`, and no other thread may access
/// those elements during the call. `dtype` must pass [`check_reducible`] for `op`.
pub(crate) unsafe fn reduce(
    dtype: DType,
    op: ReduceOp,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    len: usize,
) {
    with_reducible!(
        dtype,
        T => unsafe { reduce_typed::<T>(op, srcs, dsts, len) },
        unreachable!("check_reducible accepted {dtype:?}")
    )
}

unsafe fn reduce_typed<T: Reducible>(
    op: ReduceOp,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    len: usize,
) {
    let n = srcs.len();
    let mut acc = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < len {
        let count = BLOCK.min(len - start);
        let acc = &mut acc[..count];
        for (k, src) in srcs.iter().enumerate() {
            // SAFETY: the caller guarantees `len` valid elements behind every source.
            let src = unsafe { std::slice::from_raw_parts((*src as *const T).add(start), count) };
            if k == 0 {
                for (a, &x) in acc.iter_mut().zip(src) {
                    *a = x.load();
                }
            } else {
                for (a, &x) in acc.iter_mut().zip(src) {
                    *a = T::combine(op, *a, x.load());
                }
            }
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a = T::divide(*a, n);
            }
        }
        for dst in dsts {
            // Raw writes: a destination may be fresh, uninitialised memory.
            let dst = (*dst as *mut T).wrapping_add(start);
            for (i, &a) in acc.iter().enumerate() {
                // SAFETY: as above; the source slices of this block are no longer alive.
                unsafe { dst.add(i).write(T::store(a)) };
            }
        }
        start += count;
    }
}

/// Elements per cache line of the smallest element type: the alignment a transport gives
/// [`partition`] so that ranks reducing neighbouring slices do not share cache lines.
pub(crate) const SLICE_ALIGN: usize = 64;

/// The part of `0..len` that rank `index` of `parts` owns. Boundaries fall on multiples of
/// `align` so that ranks writing neighbouring parts do not share cache lines.
pub(crate) fn partition(len: usize, parts: usize, index: usize, align: usize) -> Range<usize> {
    let units = len.div_ceil(align);
    let bound = |i: usize| (units * i / parts * align).min(len);
    bound(index)..bound(index + 1)
}

/// A row-major buffer and the box inside it that a copy reads or writes.
pub(crate) struct Region<'a, P> {
    pub ptr: P,
    pub shape: &'a [usize],
    pub start: &'a [usize],
}

/// Part `index` along `dim` of a row-major concatenation of equal parts: rows of `len` bytes,
/// contiguous in the part and `stride` bytes apart in the whole, one per index of the
/// dimensions before `dim`.
struct PartRows {
    count: usize,
    len: usize,
    stride: usize,
    /// Where the part's first row starts in the whole.
    first: usize,
}

impl PartRows {
    fn of(part: &[usize], whole: &[usize], (dim, index): (usize, usize), elem_size: usize) -> Self {
        debug_assert!(part.len() == whole.len() && dim < part.len());
        debug_assert!((index + 1) * part[dim] <= whole[dim]);
        debug_assert!((0..part.len()).all(|d| d == dim || part[d] == whole[d]));
        let len = part[dim..].iter().product::<usize>() * elem_size;
        Self {
            count: part[..dim].iter().product(),
            len,
            stride: whole[dim..].iter().product::<usize>() * elem_size,
            // The dimensions after `dim` are whole in both, so each part spans `len` of a row.
            first: index * len,
        }
    }

    /// Each row's offset in the part and in the whole.
    fn offsets(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.count).map(|row| (row * self.len, self.first + row * self.stride))
    }
}

/// Copies the whole row-major tensor of shape `part` at `src` into `dst`, of shape `whole`, as
/// part `index` of the concatenation along `dim` that `whole` is.
///
/// # Safety
/// `src` must hold a `part` and `dst` a `whole` that contains part `index`, and no other
/// thread may write that part of `dst` during the call.
pub(crate) unsafe fn copy_to_part(
    src: *const u8,
    part: &[usize],
    (dst, whole): (*mut u8, &[usize]),
    at: (usize, usize),
    elem_size: usize,
) {
    let rows = PartRows::of(part, whole, at, elem_size);
    for (in_part, in_whole) in rows.offsets() {
        // SAFETY: each row lies inside both buffers, as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src.add(in_part), dst.add(in_whole), rows.len) };
    }
}

/// Copies part `index` along `dim` of the row-major `whole` at `src` into `dst`, which holds it
/// whole, as a tensor of shape `part`.
///
/// # Safety
/// `src` must hold a `whole` that contains part `index` and `dst` a `part`, and no other
/// thread may write `dst` during the call.
pub(crate) unsafe fn copy_from_part(
    (src, whole): (*const u8, &[usize]),
    at: (usize, usize),
    dst: *mut u8,
    part: &[usize],
    elem_size: usize,
) {
    let rows = PartRows::of(part, whole, at, elem_size);
    for (in_part, in_whole) in rows.offsets() {
        // SAFETY: each row lies inside both buffers, as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src.add(in_whole), dst.add(in_part), rows.len) };
    }
}

/// Copies a box of shape `extent` between two row-major buffers of `elem_size`-byte elements.
/// Trailing dimensions that both buffers hold whole are merged, so a box that is contiguous is
/// copied with one `memcpy` per row.
///
/// # Safety
/// Both regions must be valid for their shapes, the box must lie inside both, and no other
/// thread may write the destination box during the call.
pub(crate) unsafe fn copy_box(
    src: Region<'_, *const u8>,
    dst: Region<'_, *mut u8>,
    extent: &[usize],
    elem_size: usize,
) {
    let rank = extent.len();
    if extent.contains(&0) {
        return;
    }
    // Dimensions split..rank form one contiguous run in both buffers.
    let mut split = rank;
    let mut run = 1;
    while split > 0 {
        let d = split - 1;
        run *= extent[d];
        split = d;
        if extent[d] != src.shape[d] || extent[d] != dst.shape[d] {
            break;
        }
    }
    let strides = |shape: &[usize]| {
        let mut strides = vec![1; rank];
        for d in (0..rank.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        strides
    };
    let (src_strides, dst_strides) = (strides(src.shape), strides(dst.shape));
    let offset = |index: &[usize], start: &[usize], strides: &[usize]| -> usize {
        (0..rank).map(|d| (start[d] + index[d]) * strides[d]).sum()
    };
    let bytes = run * elem_size;
    let mut index = vec![0; rank];
    loop {
        let from = offset(&index, src.start, &src_strides) * elem_size;
        let to = offset(&index, dst.start, &dst_strides) * elem_size;
        // SAFETY: the caller guarantees the box lies inside both buffers.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr.add(from), dst.ptr.add(to), bytes) };
        // Advance the odometer over the dimensions before `split`.
        let mut d = split;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < extent[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_covers_everything_once() {
        for len in [0, 1, 15, 16, 17, 1000, 4099] {
            for parts in 1..9 {
                let mut next = 0;
                for i in 0..parts {
                    let r = partition(len, parts, i, 16);
                    assert_eq!(r.start, next);
                    assert!(r.start == len || r.start.is_multiple_of(16));
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn copy_box_places_a_narrowed_slab() {
        // src [2, 3] whole into dst [2, 6] at column 3.
        let src: Vec<u32> = (0..6).collect();
        let mut dst = vec![99u32; 12];
        unsafe {
            copy_box(
                Region {
                    ptr: src.as_ptr() as *const u8,
                    shape: &[2, 3],
                    start: &[0, 0],
                },
                Region {
                    ptr: dst.as_mut_ptr() as *mut u8,
                    shape: &[2, 6],
                    start: &[0, 3],
                },
                &[2, 3],
                4,
            )
        };
        assert_eq!(dst, vec![99, 99, 99, 0, 1, 2, 99, 99, 99, 3, 4, 5]);
    }

    #[test]
    fn parts_along_any_dim_concatenate_and_come_back() {
        // Three parts of [2, p, 4] along each dimension in turn, as `cat` would lay them out.
        for dim in 0..3 {
            let mut part = vec![2, 2, 4];
            part[dim] = 1 + dim;
            let mut whole = part.clone();
            whole[dim] *= 3;
            let len: usize = part.iter().product();
            let parts: Vec<Vec<u32>> = (0..3u32)
                .map(|r| (0..len as u32).map(|i| 1000 * r + i).collect())
                .collect();
            let mut out = vec![0u32; 3 * len];
            for (r, p) in parts.iter().enumerate() {
                let dst = (out.as_mut_ptr() as *mut u8, whole.as_slice());
                unsafe { copy_to_part(p.as_ptr() as *const u8, &part, dst, (dim, r), 4) };
            }
            // Element [i, j, k] of the whole is element [.., j - r * part[dim], ..] of part r.
            let strides = |s: &[usize]| [s[1] * s[2], s[2], 1];
            let (ws, ps) = (strides(&whole), strides(&part));
            for (at, &v) in out.iter().enumerate() {
                let mut index = [at / ws[0], at % ws[0] / ws[1], at % ws[1]];
                let r = index[dim] / part[dim];
                index[dim] %= part[dim];
                let i: usize = (0..3).map(|d| index[d] * ps[d]).sum();
                assert_eq!(v, parts[r][i], "dim {dim}, element {at}");
            }
            for (r, p) in parts.iter().enumerate() {
                let mut back = vec![0u32; len];
                let src = (out.as_ptr() as *const u8, whole.as_slice());
                unsafe { copy_from_part(src, (dim, r), back.as_mut_ptr() as *mut u8, &part, 4) };
                assert_eq!(&back, p, "dim {dim}, part {r}");
            }
        }
    }

    #[test]
    fn half_sums_round_once() {
        let a = [f16::from_f32(1.0), f16::from_f32(2048.0)];
        let b = [f16::from_f32(1.0), f16::from_f32(1.0)];
        let c = [f16::from_f32(1.0), f16::from_f32(1.0)];
        let mut out = [f16::ZERO; 2];
        unsafe {
            reduce(
                DType::F16,
                ReduceOp::Sum,
                &[a.as_ptr() as _, b.as_ptr() as _, c.as_ptr() as _],
                &[out.as_mut_ptr() as _],
                2,
            )
        };
        // 2048 + 1 + 1 in f32 is 2050, exactly representable in f16; adding in f16 would lose both 1s.
        assert_eq!(out, [f16::from_f32(3.0), f16::from_f32(2050.0)]);
    }
}
