//! Which gradients travel together: parameters grouped into buckets of about `cap` bytes, in the
//! order their gradients are expected to be ready, one dtype per bucket.

use burn::tensor::DType;

/// Which parameters travel together, in launch order: each bucket's parameter indices in
/// buffer order, and its buffer's length (their elements, plus the zeros a reduce-scatter
/// needs to split evenly).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buckets {
    /// Parameter indices of each bucket.
    pub members: Vec<Vec<usize>>,
    /// Elements of each bucket's buffer.
    pub lengths: Vec<usize>,
}

impl Buckets {
    /// Packs parameters (`numels[i]` elements of `dtypes[i]`) in `order` into buckets of at
    /// most `cap` bytes (a larger parameter gets a bucket of its own), starting a new bucket
    /// whenever the dtype changes; no padding.
    pub fn packed(order: &[usize], numels: &[usize], dtypes: &[DType], cap: usize) -> Self {
        Self::packed_apart(order, numels, dtypes, &vec![false; numels.len()], cap)
    }

    /// [`Self::packed`], starting a new bucket also wherever `apart` changes: parameters
    /// marked apart (experts', reduced over other ranks) never share a bucket with others.
    pub fn packed_apart(
        order: &[usize],
        numels: &[usize],
        dtypes: &[DType],
        apart: &[bool],
        cap: usize,
    ) -> Self {
        let bytes = |p: usize| numels[p] * dtypes[p].size();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut filled = 0;
        for &param in order {
            let fits = members.last().is_some_and(|bucket| {
                dtypes[bucket[0]] == dtypes[param]
                    && apart[bucket[0]] == apart[param]
                    && filled + bytes(param) <= cap
            });
            if fits {
                members.last_mut().unwrap().push(param);
                filled += bytes(param);
            } else {
                members.push(vec![param]);
                filled = bytes(param);
            }
        }
        let lengths = members
            .iter()
            .map(|bucket| bucket.iter().map(|&p| numels[p]).sum())
            .collect();
        Self { members, lengths }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_in_order_under_the_cap_and_splits_dtypes() {
        let f = DType::F32;
        let buckets = Buckets::packed(&[3, 2, 1, 0], &[10, 10, 50, 7], &[f, f, DType::F16, f], 80);
        assert_eq!(buckets.members, vec![vec![3], vec![2], vec![1, 0]]);
        assert_eq!(buckets.lengths, vec![7, 50, 20]);
        let apart = Buckets::packed_apart(
            &[0, 1, 2, 3],
            &[1; 4],
            &[f; 4],
            &[false, true, true, false],
            80,
        );
        assert_eq!(apart.members, vec![vec![0], vec![1, 2], vec![3]]);
    }
}
