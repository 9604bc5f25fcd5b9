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

/// A binary section of a fixed-size datatype read as float64, flat, as numpy's
/// `np.frombuffer(section, dtype).astype(np.float64)` reads it (BOOL: any byte but 0 is 1.0). None
/// for BYTES or an unknown datatype, or a section that is not a whole number of elements.
pub fn binary_as_f64(datatype: &str, section: &[u8]) -> Option<Vec<f64>> {
    let size = element_size(datatype)?;
    if section.len() % size != 0 {
        return None;
    }
    let read = |b: &[u8]| -> f64 {
        let mut le = [0u8; 8];
        le[..size].copy_from_slice(b);
        let (two, four) = ([le[0], le[1]], [le[0], le[1], le[2], le[3]]);
        match datatype {
            "BOOL" => f64::from(u8::from(le[0] != 0)),
            "UINT8" => f64::from(le[0]),
            "INT8" => f64::from(le[0] as i8),
            "UINT16" => f64::from(u16::from_le_bytes(two)),
            "INT16" => f64::from(i16::from_le_bytes(two)),
            "FP16" => f16_bits_as_f64(u16::from_le_bytes(two)),
            "BF16" => f64::from(f32::from_bits(u32::from(u16::from_le_bytes(two)) << 16)),
            "UINT32" => f64::from(u32::from_le_bytes(four)),
            "INT32" => f64::from(i32::from_le_bytes(four)),
            "FP32" => f64::from(f32::from_le_bytes(four)),
            "UINT64" => u64::from_le_bytes(le) as f64,
            "INT64" => i64::from_le_bytes(le) as f64,
            _ => f64::from_le_bytes(le), // FP64, the only 8-byte datatype left
        }
    };
    Some(section.chunks_exact(size).map(read).collect())
}

/// A JSON number of an answer (as protocol::answers hands them over: float64, int64 or uint64).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum JsonNumber {
    Float(f64),
    Int(i64),
    UInt(u64),
}

/// A JSON number cast to `datatype` and read back as float64, as numpy's
/// `np.array(numbers).astype(dtype).astype(np.float64)` reads a well-formed answer: floats rounded
/// to the datatype's precision (to nearest, ties to even; beyond its range ±Inf), integers of a
/// narrower type wrapped as C casts wrap them, floats into an integer type truncated, BOOL 1.0 for
/// anything but 0. An unknown datatype keeps the number as it is.
pub fn json_as_f64(datatype: &str, number: JsonNumber) -> f64 {
    let wide = match number {
        JsonNumber::Float(f) => f,
        JsonNumber::Int(i) => i as f64,
        JsonNumber::UInt(u) => u as f64,
    };
    // An integer datatype's value from an integer (wrapped) or a float (truncated toward zero).
    let int = |wrap: fn(i64) -> f64| match number {
        JsonNumber::Float(f) => wrap(f as i64),
        JsonNumber::Int(i) => wrap(i),
        JsonNumber::UInt(u) => wrap(u as i64),
    };
    match datatype {
        "FP64" => wide,
        "FP32" => f64::from(match number {
            JsonNumber::Float(f) => f as f32,
            JsonNumber::Int(i) => i as f32,
            JsonNumber::UInt(u) => u as f32,
        }),
        "FP16" => round_to_f16(wide),
        "BF16" => round_to_bf16(wide as f32),
        "BOOL" => f64::from(u8::from(wide != 0.0)),
        "INT8" => int(|i| f64::from(i as i8)),
        "UINT8" => int(|i| f64::from(i as u8)),
        "INT16" => int(|i| f64::from(i as i16)),
        "UINT16" => int(|i| f64::from(i as u16)),
        "INT32" => int(|i| f64::from(i as i32)),
        "UINT32" => int(|i| f64::from(i as u32)),
        "INT64" => int(|i| i as f64),
        "UINT64" => match number {
            JsonNumber::UInt(u) => u as f64,
            JsonNumber::Int(i) => (i as u64) as f64,
            JsonNumber::Float(f) => f as u64 as f64,
        },
        _ => wide,
    }
}

/// An IEEE half's bits as float64 (exact: every half is a float64).
fn f16_bits_as_f64(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((bits >> 10) & 0x1F);
    let fraction = f64::from(bits & 0x03FF);
    sign * match exponent {
        0 => fraction * 2f64.powi(-24),
        0x1F if fraction == 0.0 => f64::INFINITY,
        0x1F => f64::NAN,
        e => (1.0 + fraction / 1024.0) * 2f64.powi(e - 15),
    }
}

/// `value` rounded to the nearest IEEE half (ties to even), as numpy's float64 → float16 cast:
/// 11 significant bits, subnormals below 2**-14 in steps of 2**-24, ±Inf from 65520 on.
fn round_to_f16(value: f64) -> f64 {
    if !value.is_finite() || value == 0.0 {
        return value;
    }
    let magnitude = value.abs();
    if magnitude >= 65520.0 {
        return f64::INFINITY.copysign(value);
    }
    // The binary exponent of a normal float64 (every value here is one: it is at least 2**-1074
    // only when it is a float64 subnormal, which rounds to 0 below).
    let exponent = ((magnitude.to_bits() >> 52) & 0x7FF) as i32 - 1023;
    let step = 2f64.powi(exponent.max(-14) - 10);
    ((magnitude / step).round_ties_even() * step).copysign(value)
}

/// `value` rounded to the nearest bfloat16 (ties to even), as ml_dtypes rounds a float32.
fn round_to_bf16(value: f32) -> f64 {
    if value.is_nan() {
        return f64::NAN;
    }
    let bits = value.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    f64::from(f32::from_bits(rounded))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_sections_read_as_numpy_reads_them() {
        let halves: Vec<u8> = [0x3C00u16, 0xC000, 0x7C00, 0x0001].iter().flat_map(|h| h.to_le_bytes()).collect();
        let read = binary_as_f64("FP16", &halves).unwrap();
        assert_eq!(read[..3], [1.0, -2.0, f64::INFINITY]);
        assert_eq!(read[3], 2f64.powi(-24), "the smallest subnormal half");
        assert!(binary_as_f64("FP16", &0x7E00u16.to_le_bytes()).unwrap()[0].is_nan());
        assert_eq!(binary_as_f64("INT8", &[0xFF, 0x7F]).unwrap(), [-1.0, 127.0]);
        assert_eq!(binary_as_f64("BOOL", &[0, 1, 2]).unwrap(), [0.0, 1.0, 1.0]);
        assert_eq!(binary_as_f64("UINT64", &u64::MAX.to_le_bytes()).unwrap(), [u64::MAX as f64]);
        assert_eq!(binary_as_f64("FP32", &0.1f32.to_le_bytes()).unwrap(), [f64::from(0.1f32)]);
        assert_eq!(binary_as_f64("BF16", &0x3F80u16.to_le_bytes()).unwrap(), [1.0]);
        assert_eq!(binary_as_f64("FP32", &[0; 6]), None, "not a whole number of elements");
        assert_eq!(binary_as_f64("BYTES", &[0; 8]), None);
    }

    #[test]
    fn json_numbers_are_cast_to_the_datatype_first() {
        assert_eq!(json_as_f64("FP32", JsonNumber::Float(0.1)), f64::from(0.1f32));
        assert_eq!(json_as_f64("FP64", JsonNumber::Float(0.1)), 0.1);
        assert_eq!(json_as_f64("FP32", JsonNumber::Float(1e39)), f64::INFINITY);
        // float16: 11 significant bits, ties to even, 65520 and above overflow.
        assert_eq!(json_as_f64("FP16", JsonNumber::Float(0.1)), 0.0999755859375);
        assert_eq!(json_as_f64("FP16", JsonNumber::Float(2049.0)), 2048.0);
        assert_eq!(json_as_f64("FP16", JsonNumber::Float(2051.0)), 2052.0);
        assert_eq!(json_as_f64("FP16", JsonNumber::Float(65519.0)), 65504.0);
        assert_eq!(json_as_f64("FP16", JsonNumber::Float(-65520.0)), f64::NEG_INFINITY);
        assert_eq!(json_as_f64("FP16", JsonNumber::Float(1e-8)), 0.0);
        assert_eq!(json_as_f64("FP16", JsonNumber::Float(3e-8)), 2f64.powi(-24));
        assert!(json_as_f64("FP16", JsonNumber::Float(f64::NAN)).is_nan());
        assert_eq!(json_as_f64("INT8", JsonNumber::Int(300)), 44.0, "wrapped as a C cast");
        assert_eq!(json_as_f64("INT32", JsonNumber::Float(-2.7)), -2.0, "truncated toward zero");
        assert_eq!(json_as_f64("UINT64", JsonNumber::UInt(u64::MAX)), u64::MAX as f64);
        assert_eq!(json_as_f64("BOOL", JsonNumber::Int(7)), 1.0);
        assert_eq!(json_as_f64("BOOL", JsonNumber::Float(0.0)), 0.0);
        assert_eq!(json_as_f64("BF16", JsonNumber::Float(1.00390625)), 1.0, "a tie rounds to even");
    }
}
