//! An answer's output against the values expected of it (sidecar/golden/compare.py's rule): the
//! datatype and shape exactly, numbers within `atol + rtol × |expected|`, NaN only where NaN is
//! expected and ±Inf only where the same infinity is, BYTES compared as bytes. The health loop judges
//! golden cases with it and rollouts compare two versions' answers with it; the messages are the
//! ones operators and tests have always read, byte for byte.

use std::fmt;

use crate::protocol::pytext::{repr_bytes, repr_str};

/// How many differing elements one output reports; the rest are counted.
pub const MAX_REPORTED_ELEMENTS: usize = 3;

/// The elements of one side of a comparison, flat in C order.
pub enum Elements<'a> {
    /// Any numeric datatype, read as float64 (as numpy's `astype(np.float64)` reads it).
    Numbers(&'a [f64]),
    /// BYTES: each element's bytes (a text as its UTF-8), and how it is quoted in a message.
    Bytes(&'a [Element]),
}

impl Elements<'_> {
    fn len(&self) -> usize {
        match self {
            Elements::Numbers(v) => v.len(),
            Elements::Bytes(v) => v.len(),
        }
    }
}

/// One BYTES element: its bytes, and its `repr` as Python writes it (a `str` and a `bytes` quote
/// differently, and the message quotes the value as the golden file or the answer had it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element {
    pub bytes: Vec<u8>,
    pub repr: String,
}

impl Element {
    /// A text element (JSON `data` of a BYTES output, a golden file's string).
    pub fn text(text: &str) -> Element {
        Element { bytes: text.as_bytes().to_vec(), repr: repr_str(text) }
    }

    /// A binary element (a BYTES output's binary section).
    pub fn binary(bytes: &[u8]) -> Element {
        Element { bytes: bytes.to_vec(), repr: repr_bytes(bytes) }
    }
}

/// What one output should be.
pub struct Expected<'a> {
    pub datatype: &'a str,
    pub shape: &'a [i64],
    pub values: Elements<'a>,
    pub atol: f64,
    pub rtol: f64,
}

/// What one output of the answer is.
pub struct Received<'a> {
    pub datatype: &'a str,
    pub shape: &'a [i64],
    pub values: Elements<'a>,
}

/// The two sides cannot be compared element by element: a caller's error (the shapes matched, so the
/// values disagree with their own shape), not a difference of the answer.
#[derive(Debug, PartialEq, Eq)]
pub enum CompareError {
    /// The element counts differ (numpy's broadcast error, Python's `zip(strict=True)` one).
    Lengths { expected: usize, got: usize },
    /// Numbers on one side, BYTES on the other, although the datatypes are equal.
    Kinds,
}

impl fmt::Display for CompareError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompareError::Lengths { expected, got } => {
                write!(f, "{expected} expected values against {got} received ones")
            }
            CompareError::Kinds => write!(f, "numbers compared with BYTES elements"),
        }
    }
}

/// Every way output `name` differs from its expectation, one message each (empty: it matches).
pub fn compare_output(name: &str, expected: &Expected, got: Option<&Received>) -> Result<Vec<String>, CompareError> {
    let header = got.map(|g| (g.datatype, g.shape));
    if let Some(mismatch) = compare_header(name, expected.datatype, expected.shape, header) {
        return Ok(vec![mismatch]);
    }
    match got {
        Some(got) => compare_values(name, expected, &got.values),
        None => Ok(Vec::new()),
    }
}

/// The output's presence, datatype and shape: the message of the first that differs, None when all
/// match (only then are the values read, and converted, at all).
pub fn compare_header(name: &str, datatype: &str, shape: &[i64], got: Option<(&str, &[i64])>) -> Option<String> {
    let Some((got_datatype, got_shape)) = got else {
        return Some(format!("output {name} missing from the answer"));
    };
    if got_datatype != datatype {
        return Some(format!("{name} datatype expected {datatype}, got {got_datatype}"));
    }
    if got_shape != shape {
        return Some(format!("{name} shape expected {}, got {}", list(shape), list(got_shape)));
    }
    None
}

/// The values of an output whose datatype and shape match (compare_header): every differing element
/// up to MAX_REPORTED_ELEMENTS, then how many more differ.
pub fn compare_values(name: &str, expected: &Expected, got: &Elements) -> Result<Vec<String>, CompareError> {
    if got.len() != expected.values.len() {
        return Err(CompareError::Lengths { expected: expected.values.len(), got: got.len() });
    }
    match (&expected.values, got) {
        (Elements::Numbers(want), Elements::Numbers(have)) => Ok(compare_numbers(name, want, have, expected)),
        (Elements::Bytes(want), Elements::Bytes(have)) => Ok(compare_bytes(name, want, have)),
        _ => Err(CompareError::Kinds),
    }
}

/// Python's `repr(list_of_ints)`.
fn list(shape: &[i64]) -> String {
    let items: Vec<String> = shape.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

fn compare_numbers(name: &str, want: &[f64], have: &[f64], expected: &Expected) -> Vec<String> {
    let wrong: Vec<usize> = (0..want.len()).filter(|&i| !number_matches(want[i], have[i], expected)).collect();
    let mut messages: Vec<String> = wrong
        .iter()
        .take(MAX_REPORTED_ELEMENTS)
        .map(|&i| {
            let (w, h) = (want[i], have[i]);
            format!("{name}[{i}] expected {}±{}, got {}", fmt_value(w), fmt_tol(expected, w), fmt_value(h))
        })
        .collect();
    messages.extend(more(name, wrong.len()));
    messages
}

/// One element within tolerance; NaN only matches NaN, and ±Inf only the same infinity, and only
/// where the expectation says so (a NaN in `want` is how a golden file says it).
fn number_matches(want: f64, have: f64, tolerance: &Expected) -> bool {
    if want.is_nan() {
        return have.is_nan();
    }
    if want.is_infinite() {
        return have == want;
    }
    // The comparison is false for a NaN or infinite `have`, as numpy's is.
    have.is_finite() && (have - want).abs() <= tolerance.atol + tolerance.rtol * want.abs()
}

fn compare_bytes(name: &str, want: &[Element], have: &[Element]) -> Vec<String> {
    let wrong: Vec<usize> = (0..want.len()).filter(|&i| want[i].bytes != have[i].bytes).collect();
    let mut messages: Vec<String> = wrong
        .iter()
        .take(MAX_REPORTED_ELEMENTS)
        .map(|&i| format!("{name}[{i}] expected {}, got {}", want[i].repr, have[i].repr))
        .collect();
    messages.extend(more(name, wrong.len()));
    messages
}

fn more(name: &str, wrong: usize) -> Option<String> {
    (wrong > MAX_REPORTED_ELEMENTS).then(|| format!("{name}: {} more elements differ", wrong - MAX_REPORTED_ELEMENTS))
}

/// A value in a message: four decimals, or four significant digits when smaller than 1e-3.
pub fn fmt_value(value: f64) -> String {
    if value.is_nan() {
        return "nan".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.into();
    }
    if value.abs() >= 1e-3 || value == 0.0 {
        format!("{value:.4}")
    } else {
        exp(value, 3)
    }
}

/// The tolerance at `value`: atol + rtol × |value| (0 where infinite or NaN is expected).
pub fn fmt_tol(expected: &Expected, value: f64) -> String {
    let tol = if value.is_finite() { expected.atol + expected.rtol * value.abs() } else { 0.0 };
    if tol >= 1e-4 {
        format!("{tol:.4}")
    } else {
        exp(tol, 1)
    }
}

/// Python's `format(value, ".{digits}e")`: Rust writes the exponent bare ("1.5e-5"), Python signed
/// and with at least two digits ("1.5e-05").
fn exp(value: f64, digits: usize) -> String {
    let text = format!("{value:.digits$e}");
    match text.split_once('e') {
        Some((mantissa, exponent)) => {
            let (sign, magnitude) = match exponent.strip_prefix('-') {
                Some(m) => ('-', m),
                None => ('+', exponent),
            };
            format!("{mantissa}e{sign}{magnitude:0>2}")
        }
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores<'a>(want: &'a [f64], atol: f64, rtol: f64, shape: &'a [i64]) -> Expected<'a> {
        Expected { datatype: "FP32", shape, values: Elements::Numbers(want), atol, rtol }
    }

    fn answer<'a>(have: &'a [f64], datatype: &'a str, shape: &'a [i64]) -> Received<'a> {
        Received { datatype, shape, values: Elements::Numbers(have) }
    }

    /// float32 values read as float64, as numpy's astype does with the model's answers.
    fn f32s(values: &[f64]) -> Vec<f64> {
        values.iter().map(|&v| v as f32 as f64).collect()
    }

    #[test]
    fn values_within_atol_plus_rtol_times_expected_pass() {
        let shape = [1, 1];
        let case = scores(&[0.7310], 1e-4, 0.0, &shape);
        let close = f32s(&[0.73109]);
        assert_eq!(compare_output("scores", &case, Some(&answer(&close, "FP32", &shape))), Ok(vec![]));
        let far = f32s(&[0.7312]);
        assert_eq!(
            compare_output("scores", &case, Some(&answer(&far, "FP32", &shape))),
            Ok(vec!["scores[0] expected 0.7310±0.0001, got 0.7312".to_string()])
        );
    }

    #[test]
    fn relative_tolerance_scales_with_the_expected_value() {
        let shape = [1, 1];
        let case = scores(&[1000.0], 0.0, 1e-3, &shape);
        let close = f32s(&[1000.9]);
        assert_eq!(compare_output("scores", &case, Some(&answer(&close, "FP32", &shape))), Ok(vec![]));
        let far = f32s(&[1001.5]);
        assert_eq!(compare_output("scores", &case, Some(&answer(&far, "FP32", &shape))).map(|m| m.len()), Ok(1));
    }

    #[test]
    fn nan_in_an_answer_fails_unless_the_expectation_holds_it() {
        let shape = [1, 2];
        let case = scores(&[0.7310, 0.5], 1e-5, 1e-4, &shape);
        let nan = [f64::NAN, 0.5];
        assert_eq!(
            compare_output("scores", &case, Some(&answer(&nan, "FP32", &shape))),
            Ok(vec!["scores[0] expected 0.7310±8.3e-05, got nan".to_string()])
        );
        let inf = [f64::INFINITY, 0.5];
        assert_eq!(compare_output("scores", &case, Some(&answer(&inf, "FP32", &shape))).map(|m| m.len()), Ok(1));
        let expects_nan = scores(&[f64::NAN, f64::INFINITY], 1e-5, 1e-4, &shape);
        let same = [f64::NAN, f64::INFINITY];
        assert_eq!(compare_output("scores", &expects_nan, Some(&answer(&same, "FP32", &shape))), Ok(vec![]));
        let other = [0.1, f64::NEG_INFINITY];
        assert_eq!(
            compare_output("scores", &expects_nan, Some(&answer(&other, "FP32", &shape))),
            Ok(vec![
                "scores[0] expected nan±0.0e+00, got 0.1000".to_string(),
                "scores[1] expected inf±0.0e+00, got -inf".to_string()
            ])
        );
    }

    #[test]
    fn datatype_and_shape_must_match_exactly_and_a_missing_output_is_named() {
        let shape = [1, 2];
        let case = scores(&[0.5, 0.5], 1e-5, 1e-4, &shape);
        let half = [0.5, 0.5];
        assert_eq!(
            compare_output("scores", &case, Some(&answer(&half, "FP64", &shape))),
            Ok(vec!["scores datatype expected FP32, got FP64".to_string()])
        );
        assert_eq!(
            compare_output("scores", &case, Some(&answer(&half, "FP32", &[2, 1]))),
            Ok(vec!["scores shape expected [1, 2], got [2, 1]".to_string()])
        );
        assert_eq!(
            compare_output("scores", &case, None),
            Ok(vec!["output scores missing from the answer".to_string()])
        );
    }

    #[test]
    fn many_differences_are_summarised() {
        let shape = [1, 10];
        let want = [0.0; 10];
        let case = scores(&want, 1e-5, 1e-4, &shape);
        let have = [1.0; 10];
        let messages = compare_output("scores", &case, Some(&answer(&have, "FP32", &shape))).unwrap();
        assert_eq!(messages.len(), 4);
        assert_eq!(messages[0], "scores[0] expected 0.0000±1.0e-05, got 1.0000");
        assert_eq!(messages[3], "scores: 7 more elements differ");
    }

    #[test]
    fn bytes_compare_as_bytes_and_are_quoted_as_given() {
        let shape = [3];
        let want = [Element::text("cat"), Element::text("dog"), Element::text("it's")];
        let case = Expected { datatype: "BYTES", shape: &shape, values: Elements::Bytes(&want), atol: 0.0, rtol: 0.0 };
        let same = [Element::binary(b"cat"), Element::text("dog"), Element::binary(b"it's")];
        let got = Received { datatype: "BYTES", shape: &shape, values: Elements::Bytes(&same) };
        assert_eq!(compare_output("label", &case, Some(&got)), Ok(vec![]));
        let other = [Element::binary(b"cow\xff\n"), Element::text("dog"), Element::binary(b"its")];
        let got = Received { datatype: "BYTES", shape: &shape, values: Elements::Bytes(&other) };
        assert_eq!(
            compare_output("label", &case, Some(&got)),
            Ok(vec![
                "label[0] expected 'cat', got b'cow\\xff\\n'".to_string(),
                "label[2] expected \"it's\", got b'its'".to_string()
            ])
        );
    }

    #[test]
    fn values_that_disagree_with_their_shape_are_an_error() {
        let shape = [2];
        let case = scores(&[0.5, 0.5], 1e-5, 1e-4, &shape);
        let one = [0.5];
        assert_eq!(
            compare_output("scores", &case, Some(&answer(&one, "FP32", &shape))),
            Err(CompareError::Lengths { expected: 2, got: 1 })
        );
    }

    #[test]
    fn numbers_are_written_as_python_formats_them() {
        // Expected texts from Python: f"{v:.4f}" / f"{v:.3e}" (_fmt) and f"{t:.4f}" / f"{t:.1e}" (_fmt_tol).
        let values: [(f64, &str); 14] = [
            (0.0, "0.0000"),
            (-0.0, "-0.0000"),
            (0.731, "0.7310"),
            (0.73125, "0.7312"),
            (0.00125, "0.0013"),
            (1e-3, "0.0010"),
            (0.00099995, "1.000e-03"),
            (1.0005e-4, "1.001e-04"),
            (-2.5e-7, "-2.500e-07"),
            (-1e-320, "-1.000e-320"),
            (1234567.89, "1234567.8900"),
            (0.12345, "0.1235"),
            (0.00012345, "1.234e-04"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for (value, text) in values {
            assert_eq!(fmt_value(value), text, "{value:?}");
        }
        let tolerances: [(f64, &str); 8] = [
            (0.0, "0.0e+00"),
            (1e-4, "0.0001"),
            (9.99e-5, "1.0e-04"),
            (5e-5, "5.0e-05"),
            (2.5e-5, "2.5e-05"),
            (1.5e-5, "1.5e-05"),
            (1e20, "100000000000000000000.0000"),
            (0.00015, "0.0001"),
        ];
        for (atol, text) in tolerances {
            let case = scores(&[], atol, 0.0, &[]);
            assert_eq!(fmt_tol(&case, 1.0), text, "{atol:?}");
        }
    }

    #[test]
    fn bytes_are_quoted_as_python_quotes_them() {
        assert_eq!(repr_bytes(b""), "b''");
        assert_eq!(repr_bytes(b"a'b"), "b\"a'b\"");
        assert_eq!(repr_bytes(b"a'b\""), "b'a\\'b\"'");
        assert_eq!(repr_bytes(b"\x00\t\\\x7f\x80"), "b'\\x00\\t\\\\\\x7f\\x80'");
    }
}
