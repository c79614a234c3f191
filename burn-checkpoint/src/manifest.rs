//! What a checkpoint's `manifest.json` records: every tensor's global shape and dtype, and for
//! each of its pieces the box it covers, the file and byte range holding it, and its checksum;
//! beside them the step and whatever the application keeps with it (its config, the layout it
//! trained in, its position in the data).

use std::collections::BTreeMap;

use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use crate::region::Region;

/// The format this crate writes and reads.
pub const FORMAT: &str = "burn-checkpoint/1";
/// The manifest's file name in a checkpoint's directory.
pub const MANIFEST: &str = "manifest.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// The training step the checkpoint was taken after.
    pub step: u64,
    /// Ranks that saved it.
    pub world: usize,
    /// Every tensor, by name.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// The application's own record.
    pub metadata: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// Its element type, as [`dtype_name`] writes it.
    pub dtype: String,
    /// Its pieces, which tile it without overlapping.
    pub shards: Vec<ShardEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The box of the tensor it holds.
    pub region: Region,
    /// Its file in the checkpoint's directory.
    pub file: String,
    /// Where its bytes start in that file.
    pub offset: u64,
    /// How many bytes it has: the box's volume times the element size.
    pub bytes: u64,
    /// CRC-32 of those bytes.
    pub crc32: u32,
}

/// The element types a checkpoint holds, by name.
const DTYPES: [(DType, &str); 12] = [
    (DType::F64, "F64"),
    (DType::F32, "F32"),
    (DType::F16, "F16"),
    (DType::BF16, "BF16"),
    (DType::I64, "I64"),
    (DType::I32, "I32"),
    (DType::I16, "I16"),
    (DType::I8, "I8"),
    (DType::U64, "U64"),
    (DType::U32, "U32"),
    (DType::U16, "U16"),
    (DType::U8, "U8"),
];

/// `dtype`'s name in a manifest; none for a type a checkpoint does not hold (quantized).
pub fn dtype_name(dtype: DType) -> Option<&'static str> {
    DTYPES
        .iter()
        .find(|(d, _)| *d == dtype)
        .map(|(_, name)| *name)
}

/// The element type a manifest names.
pub fn dtype_of(name: &str) -> Option<DType> {
    DTYPES.iter().find(|(_, n)| *n == name).map(|(d, _)| *d)
}
