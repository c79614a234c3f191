//! Which gradients travel together: parameters grouped into buckets of about `cap` bytes, in the
//! order their gradients are expected to be ready, one dtype per bucket.

use burn::tensor::DType;

/// Buckets of parameter indices, in launch order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BucketPlan {
    pub buckets: Vec<Vec<usize>>,
    pub bucket_of: Vec<usize>,
}

impl BucketPlan {
    /// Packs parameters in `order` into buckets of at most `cap` bytes (a larger parameter gets a
    /// bucket of its own), starting a new bucket whenever the dtype changes.
    pub fn new(order: &[usize], bytes: &[usize], dtypes: &[DType], cap: usize) -> Self {
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut filled = 0;
        for &param in order {
            let fits = buckets.last().is_some_and(|bucket| {
                dtypes[bucket[0]] == dtypes[param] && filled + bytes[param] <= cap
            });
            if fits {
                buckets.last_mut().unwrap().push(param);
                filled += bytes[param];
            } else {
                buckets.push(vec![param]);
                filled = bytes[param];
            }
        }
        let mut bucket_of = vec![0; order.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for &param in bucket {
                bucket_of[param] = b;
            }
        }
        Self { buckets, bucket_of }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_in_order_under_the_cap_and_splits_dtypes() {
        let f = DType::F32;
        let plan = BucketPlan::new(
            &[3, 2, 1, 0],
            &[40, 40, 100, 30],
            &[f, f, DType::F16, f],
            80,
        );
        assert_eq!(plan.buckets, vec![vec![3], vec![2], vec![1, 0]]);
        assert_eq!(plan.bucket_of, vec![2, 2, 1, 0]);
    }
}
