//! KServe v2 tensor datatypes: sizes and ranges, as sidecar/protocol/datatypes.py names them.

/// Bytes per element of each fixed-size datatype (BYTES has none).
pub fn element_size(datatype: &str) -> Option<usize> {
    Some(match datatype {
        "BOOL" | "UINT8" | "INT8" => 1,
        "UINT16" | "INT16" | "FP16" | "BF16" => 2,
        "UINT32" | "INT32" | "FP32" => 4,
        "UINT64" | "INT64" | "FP64" => 8,
        _ => return None,
    })
}

/// Every v2 datatype, sorted as the Python side lists them in messages.
pub const ALL_SORTED: [&str; 14] = [
    "BF16", "BOOL", "BYTES", "FP16", "FP32", "FP64", "INT16", "INT32", "INT64", "INT8", "UINT16", "UINT32", "UINT64",
    "UINT8",
];

/// The range of an integer datatype, (min, max), as i128 so that UINT64 fits.
pub fn int_range(datatype: &str) -> Option<(i128, i128)> {
    Some(match datatype {
        "UINT8" => (0, u8::MAX as i128),
        "UINT16" => (0, u16::MAX as i128),
        "UINT32" => (0, u32::MAX as i128),
        "UINT64" => (0, u64::MAX as i128),
        "INT8" => (i8::MIN as i128, i8::MAX as i128),
        "INT16" => (i16::MIN as i128, i16::MAX as i128),
        "INT32" => (i32::MIN as i128, i32::MAX as i128),
        "INT64" => (i64::MIN as i128, i64::MAX as i128),
        _ => return None,
    })
}

/// The index of the first NaN or ±Inf in a little-endian binary tensor of a float datatype (an
/// exponent of all ones for FP16 and BF16); None when all are finite or the datatype is not a float.
pub fn first_non_finite(datatype: &str, chunk: &[u8]) -> Option<usize> {
    match datatype {
        "FP16" => chunk.chunks_exact(2).position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7C00 == 0x7C00),
        "BF16" => chunk.chunks_exact(2).position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7F80 == 0x7F80),
        "FP32" => chunk.chunks_exact(4).position(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()),
        "FP64" => chunk
            .chunks_exact(8)
            .position(|b| !f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]).is_finite()),
        _ => None,
    }
}

/// The largest finite value of a float datatype.
pub fn float_max(datatype: &str) -> Option<f64> {
    Some(match datatype {
        "FP16" => 65504.0,
        "FP32" => f32::MAX as f64,
        "FP64" => f64::MAX,
        _ => return None,
    })
}
