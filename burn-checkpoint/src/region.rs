//! A box in a tensor: where a piece sits (its offset along every dimension) and how far it
//! reaches. Elements are row-major, as burn's `TensorData` lays them out.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The elements `offsets[d] .. offsets[d] + extents[d]` along every dimension `d`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Region {
    pub offsets: Vec<usize>,
    pub extents: Vec<usize>,
}

impl Region {
    /// The box at `offsets` reaching `extents` (one of each per dimension).
    pub fn new(offsets: Vec<usize>, extents: Vec<usize>) -> Self {
        assert_eq!(
            offsets.len(),
            extents.len(),
            "an offset and an extent per dimension"
        );
        Self { offsets, extents }
    }

    /// All of a tensor shaped `shape`.
    pub fn whole(shape: &[usize]) -> Self {
        Self::new(vec![0; shape.len()], shape.to_vec())
    }

    /// The elements `range` along `dim` of a tensor shaped `shape`, all of every other
    /// dimension: a tensor-parallel block.
    pub fn block(shape: &[usize], dim: usize, range: Range<usize>) -> Self {
        let mut region = Self::whole(shape);
        region.offsets[dim] = range.start;
        region.extents[dim] = range.len();
        region
    }

    /// Elements in the box.
    pub fn volume(&self) -> usize {
        self.extents.iter().product()
    }

    /// Whether the box lies inside a tensor shaped `shape`.
    pub fn is_within(&self, shape: &[usize]) -> bool {
        self.offsets.len() == shape.len()
            && (0..shape.len()).all(|d| self.offsets[d] + self.extents[d] <= shape[d])
    }

    /// The elements both boxes hold; none when they share none.
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        if self.offsets.len() != other.offsets.len() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut extents = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let start = self.offsets[d].max(other.offsets[d]);
            let end = (self.offsets[d] + self.extents[d]).min(other.offsets[d] + other.extents[d]);
            if end <= start {
                return None;
            }
            offsets.push(start);
            extents.push(end - start);
        }
        Some(Region::new(offsets, extents))
    }

    /// The boxes covering elements `range`, in row-major order, of a tensor shaped `shape`:
    /// a partial row, whole rows, a partial row, at every level. A flat shard of a parameter
    /// (ZeRO's) is handed in as these.
    pub fn from_flat(shape: &[usize], range: Range<usize>) -> Vec<Region> {
        let mut out = Vec::new();
        flat_boxes(shape, &mut Vec::new(), range, &mut out);
        out
    }
}

/// Pushes the boxes of `range` in the sub-tensor shaped `shape` under the leading indices
/// `leading` (each an extent of one).
fn flat_boxes(
    shape: &[usize],
    leading: &mut Vec<usize>,
    range: Range<usize>,
    out: &mut Vec<Region>,
) {
    if range.is_empty() {
        return;
    }
    let Some((&rows, rest)) = shape.split_first() else {
        out.push(under(leading, &[], &[]));
        return;
    };
    if rest.is_empty() {
        out.push(under(leading, &[range.start], &[range.len()]));
        return;
    }
    let row: usize = rest.iter().product();
    debug_assert!(range.end <= rows * row);
    let (first, last) = (range.start / row, (range.end - 1) / row);
    if first == last {
        let within = range.start % row..range.start % row + range.len();
        in_row(rest, leading, first, within, out);
        return;
    }
    let mut whole_from = first;
    if !range.start.is_multiple_of(row) {
        in_row(rest, leading, first, range.start % row..row, out);
        whole_from += 1;
    }
    let whole_to = range.end / row;
    if whole_to > whole_from {
        let mut offsets = vec![whole_from];
        offsets.extend(std::iter::repeat_n(0, rest.len()));
        let mut extents = vec![whole_to - whole_from];
        extents.extend_from_slice(rest);
        out.push(under(leading, &offsets, &extents));
    }
    if !range.end.is_multiple_of(row) {
        in_row(rest, leading, whole_to, 0..range.end % row, out);
    }
}

/// The boxes of `within` in row `r`, whose elements are shaped `rest`.
fn in_row(
    rest: &[usize],
    leading: &mut Vec<usize>,
    r: usize,
    within: Range<usize>,
    out: &mut Vec<Region>,
) {
    leading.push(r);
    flat_boxes(rest, leading, within, out);
    leading.pop();
}

/// The box at `offsets` reaching `extents` under the leading indices `leading`.
fn under(leading: &[usize], offsets: &[usize], extents: &[usize]) -> Region {
    let mut region = Region::new(leading.to_vec(), vec![1; leading.len()]);
    region.offsets.extend_from_slice(offsets);
    region.extents.extend_from_slice(extents);
    region
}

/// Copies the elements of `part` (inside both boxes) from `src`, which holds box `from`, into
/// `dst`, which holds box `to`; elements are `size` bytes.
pub(crate) fn copy_part(
    src: &[u8],
    from: &Region,
    dst: &mut [u8],
    to: &Region,
    part: &Region,
    size: usize,
) {
    let n = part.extents.len();
    if part.volume() == 0 {
        return;
    }
    // Row-major position of a global index inside a box, in elements.
    let linear = |region: &Region, index: &[usize]| {
        (0..n).fold(0, |at, d| {
            at * region.extents[d] + index[d] - region.offsets[d]
        })
    };
    let run = part.extents.last().copied().unwrap_or(1) * size;
    let mut index = part.offsets.clone();
    loop {
        let (s, t) = (linear(from, &index) * size, linear(to, &index) * size);
        dst[t..t + run].copy_from_slice(&src[s..s + run]);
        // The next run: count up the indices before the last, odometer-wise.
        let mut d = n.saturating_sub(1);
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < part.offsets[d] + part.extents[d] {
                break;
            }
            index[d] = part.offsets[d];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flat indices a box covers in a tensor shaped `shape`.
    fn indices(shape: &[usize], region: &Region) -> Vec<usize> {
        let whole = Region::whole(shape);
        let values: Vec<u8> = (0..whole.volume()).map(|i| i as u8).collect();
        let mut out = vec![0u8; region.volume()];
        copy_part(&values, &whole, &mut out, region, region, 1);
        out.into_iter().map(usize::from).collect()
    }

    #[test]
    fn a_flat_range_is_covered_by_its_boxes_in_order() {
        for shape in [vec![7], vec![3, 4], vec![2, 3, 4], vec![]] {
            let n: usize = shape.iter().product();
            for start in 0..=n {
                for end in start..=n {
                    let boxes = Region::from_flat(&shape, start..end);
                    let covered: Vec<usize> =
                        boxes.iter().flat_map(|b| indices(&shape, b)).collect();
                    assert_eq!(
                        covered,
                        (start..end).collect::<Vec<_>>(),
                        "{shape:?} {start}..{end}"
                    );
                    assert!(boxes.iter().all(|b| b.is_within(&shape) && b.volume() > 0));
                    assert!(boxes.len() <= 2 * shape.len().max(1), "{boxes:?}");
                }
            }
        }
    }

    #[test]
    fn boxes_intersect_and_copy_between_each_other() {
        let a = Region::new(vec![0, 2], vec![3, 3]);
        let b = Region::new(vec![1, 0], vec![4, 4]);
        assert_eq!(a.intersect(&b), Some(Region::new(vec![1, 2], vec![2, 2])));
        assert_eq!(a.intersect(&Region::new(vec![3, 0], vec![1, 2])), None);
        assert_eq!(
            indices(&[4, 5], &Region::block(&[4, 5], 1, 1..3)),
            [1, 2, 6, 7, 11, 12, 16, 17]
        );
    }
}
