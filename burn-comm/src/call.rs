//! What a rank asks of its group: used to check that every rank asks the same thing, and to
//! name the call in errors.

use std::fmt;

use burn::tensor::{DType, Shape};

/// How values from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum, in rank order.
    Sum,
    /// Element-wise sum in rank order, divided by the group size (floating point only).
    Avg,
    /// Element-wise maximum (NaN wins).
    Max,
    /// Element-wise minimum (NaN wins).
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        };
        f.write_str(name)
    }
}

/// The operation of a collective call, with the arguments every rank must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    AllReduce(ReduceOp),
    AllGather { dim: usize },
    ReduceScatter { op: ReduceOp, dim: usize },
    Broadcast { root: usize },
    AllToAll { split_dim: usize, concat_dim: usize },
    Barrier,
    Split,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::AllReduce(op) => write!(f, "all_reduce({op})"),
            Op::AllGather { dim } => write!(f, "all_gather(dim {dim})"),
            Op::ReduceScatter { op, dim } => write!(f, "reduce_scatter({op}, dim {dim})"),
            Op::Broadcast { root } => write!(f, "broadcast(root {root})"),
            Op::AllToAll {
                split_dim,
                concat_dim,
            } => write!(
                f,
                "all_to_all(split dim {split_dim}, concat dim {concat_dim})"
            ),
            Op::Barrier => f.write_str("barrier"),
            Op::Split => f.write_str("split"),
        }
    }
}

/// A point-to-point call, as errors name it.
#[derive(Debug, Clone)]
pub(crate) enum PointToPoint {
    Send {
        to: usize,
    },
    Recv {
        from: usize,
        dtype: DType,
        shape: Vec<usize>,
    },
}

impl fmt::Display for PointToPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PointToPoint::Send { to } => write!(f, "send(to {to})"),
            PointToPoint::Recv { from, dtype, shape } => {
                write!(f, "recv(from {from}) of {dtype:?} {shape:?}")
            }
        }
    }
}

/// One rank's call: the operation and the tensor it brings.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Call {
    pub op: Op,
    pub dtype: Option<DType>,
    /// Held inline (up to five dimensions): a call is made and cloned on every collective.
    pub shape: Shape,
}

impl Call {
    pub fn new(op: Op, dtype: DType, shape: &[usize]) -> Self {
        Self {
            op,
            dtype: Some(dtype),
            shape: Shape::from(shape),
        }
    }

    /// A digest of the call and of `framing` (the version of how a transport frames calls),
    /// alike in every process of one build: ranks of another process compare digests, which is
    /// much faster than writing out and comparing the calls' text.
    pub fn digest(&self, framing: u64) -> u64 {
        digest_of(&(framing, self))
    }

    /// A call that carries no tensor (barrier, split).
    pub fn bare(op: Op) -> Self {
        Self {
            op,
            dtype: None,
            shape: Shape::from([0usize; 0]),
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dtype {
            Some(dtype) => write!(f, "{} on {:?} {:?}", self.op, dtype, &self.shape[..]),
            None => write!(f, "{}", self.op),
        }
    }
}

/// A digest of `value` (see [`Call::digest`]).
pub(crate) fn digest_of(value: &impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut hasher = WordHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// The digests' hash: alike in every process, unlike std's default hasher, and a word a step,
/// as a call's fields are words and every collective digests its call. Each step is a
/// bijection of the state and of the word, so two inputs of one length that differ in one
/// word never collide; the length is digested too.
struct WordHasher {
    state: u64,
    bytes: u64,
}

impl WordHasher {
    fn new() -> Self {
        // Not zero, which the mixing keeps: leading zero words would leave no trace.
        Self {
            state: 0x243f_6a88_85a3_08d3,
            bytes: 0,
        }
    }

    fn mix(state: u64, word: u64) -> u64 {
        let x = (state ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^ (x >> 32)
    }
}

impl std::hash::Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.bytes += bytes.len() as u64;
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let word = u64::from_le_bytes(word.try_into().expect("eight bytes"));
            self.state = Self::mix(self.state, word);
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            // The count of bytes in the top byte, which they leave free.
            let word = u64::from_le_bytes(word) | (rest.len() as u64) << 56;
            self.state = Self::mix(self.state, word);
        }
    }

    /// The length, then MurmurHash3's finaliser, so that every bit of the state moves every
    /// bit of the digest.
    fn finish(&self) -> u64 {
        let mut h = Self::mix(self.state, self.bytes);
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// The FNV-1a hash: unlike std's default hasher, it hashes alike in every process.
#[cfg(any(feature = "cuda", test))]
pub(crate) struct Fnv1a(u64);

#[cfg(any(feature = "cuda", test))]
impl Fnv1a {
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

#[cfg(any(feature = "cuda", test))]
impl std::hash::Hasher for Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    #[test]
    fn calls_that_differ_have_other_digests() {
        let call = Call::new(Op::AllGather { dim: 0 }, DType::F32, &[2, 3]);
        assert_eq!(call.digest(0), call.clone().digest(0));
        assert_ne!(call.digest(0), call.digest(1));
        let others = [
            Call::new(Op::AllGather { dim: 1 }, DType::F32, &[2, 3]),
            Call::new(Op::AllGather { dim: 0 }, DType::F16, &[2, 3]),
            Call::new(Op::AllGather { dim: 0 }, DType::F32, &[3, 2]),
            Call::new(Op::AllGather { dim: 0 }, DType::F32, &[2, 3, 1]),
            Call::new(Op::Broadcast { root: 0 }, DType::F32, &[2, 3]),
            Call::bare(Op::Barrier),
            Call::new(Op::Barrier, DType::F32, &[]),
        ];
        for other in others {
            assert_ne!(call.digest(0), other.digest(0), "{call} and {other}");
        }
    }

    #[test]
    fn shapes_and_short_writes_have_digests_of_their_own() {
        let mut seen = std::collections::HashSet::new();
        for a in 0..48 {
            for b in 0..48 {
                for shape in [vec![a, b], vec![a, b, 1], vec![a * 48 + b]] {
                    let call = Call::new(Op::AllReduce(ReduceOp::Sum), DType::F32, &shape);
                    assert!(seen.insert(call.digest(0)), "{call}");
                }
            }
        }
        let bytes = |bytes: &[u8]| {
            let mut hasher = WordHasher::new();
            hasher.write(bytes);
            hasher.finish()
        };
        assert_ne!(bytes(&[1, 2, 3]), bytes(&[1, 2, 3, 0]));
        assert_ne!(bytes(&[0; 7]), bytes(&[0; 8]));
        assert_ne!(bytes(&[]), bytes(&[0]));
        // Leading zero words, and inputs that differ only in their length.
        assert_ne!(bytes(&[0; 8]), bytes(&[0; 16]));
        assert_ne!(bytes(&[]), bytes(&[0; 8]));
        assert_ne!(
            digest_of(&(DType::F64, [0usize])),
            digest_of(&(DType::F32, [0usize; 0]))
        );
        let sum = Call::new(Op::AllReduce(ReduceOp::Sum), DType::F32, &[1, 5]);
        let avg = Call::new(Op::AllReduce(ReduceOp::Avg), DType::Flex32, &[5]);
        assert_ne!(sum.digest(0), avg.digest(0));
    }

    #[test]
    fn fnv1a_matches_its_published_test_vectors() {
        let hash = |bytes: &[u8]| {
            let mut hasher = Fnv1a::new();
            hasher.write(bytes);
            hasher.finish()
        };
        assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
