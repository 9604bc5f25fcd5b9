//! JSON as Triton reads it, strictly: the request checks must accept exactly the documents Triton
//! accepts and refuse, as `malformed`, what it would choke on.
//!
//! Why a parser of our own rather than serde_json:
//! - Triton's parser (RapidJSON) takes the literals `NaN`, `Infinity` and `-Infinity`; a request that
//!   carries them must be refused as `non_finite` naming the element, not as unreadable JSON;
//! - a key twice in one object is refused: the sidecar would check the last value, Triton use the
//!   first;
//! - numbers are kept as their text until a check reads them: a check converts each once, in the same
//!   pass that judges it, and strings borrow the body unless they hold escapes (no copy per key).

use std::borrow::Cow;
use std::fmt;

/// Nesting deeper than this is refused (a stack bound, as CPython's recursion limit was before).
pub const MAX_DEPTH: usize = 512;

#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    Null,
    Bool(bool),
    /// A number as written (RFC 8259 grammar, checked): `integer` when it has no fraction or exponent;
    /// its magnitude is below 10^`below_exp10` (so most checks need not convert it at all).
    Number {
        text: &'a str,
        integer: bool,
        below_exp10: i32,
    },
    /// The literals `NaN`, `Infinity`, `-Infinity`.
    NonFinite(f64),
    Str(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    /// An array whose elements are all numbers (tensor data), kept as its text with what a check
    /// needs to know without reading the numbers again: no `Value` per element is built.
    Numbers(Numbers<'a>),
    /// Members in document order; keys are unique (duplicates are refused while parsing).
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

/// A run of numbers: the text between an array's brackets, and a summary taken while parsing it.
#[derive(Debug, Clone, PartialEq)]
pub struct Numbers<'a> {
    /// The elements and the commas between them (white space included), without the brackets.
    pub text: &'a str,
    pub count: usize,
    /// Some element has a fraction or an exponent.
    pub any_float: bool,
    /// Some integer element is negative.
    pub any_negative: bool,
    /// Some integer element has more than 18 digits (it may not fit i64).
    pub any_wide: bool,
    /// Every element's magnitude is below 10^`below_exp10`.
    pub below_exp10: i32,
}

impl<'a> Numbers<'a> {
    /// The elements, each a `Value::Number` (the text was checked while parsing).
    pub fn iter(&self) -> impl Iterator<Item = Value<'a>> + '_ {
        self.text.split(',').map(|piece| {
            let text = piece.trim_matches(|c| matches!(c, ' ' | '\n' | '\r' | '\t'));
            let integer = !text.contains(['.', 'e', 'E']);
            // Only the summary's bound is known for one element; a reader that needs its exact
            // magnitude converts it (checks look at `below_exp10` of the run, not of its elements).
            Value::Number { text, integer, below_exp10: i32::MAX }
        })
    }
}

/// What a JSON number is, as Python (and numpy after it) reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    /// An integer that fits i64.
    Int(i64),
    /// A non-negative integer above i64::MAX that fits u64.
    UInt(u64),
    /// An integer wider than 64 bits.
    BigInt,
    Float(f64),
}

impl<'a> Value<'a> {
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        match self {
            Value::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The elements of an array (a run of numbers read out of its text), None when not an array.
    pub fn items(&self) -> Option<Cow<'_, [Value<'a>]>> {
        match self {
            Value::Array(items) => Some(Cow::Borrowed(items.as_slice())),
            Value::Numbers(run) => Some(Cow::Owned(run.iter().collect())),
            _ => None,
        }
    }

    pub fn is_array(&self) -> bool {
        matches!(self, Value::Array(_) | Value::Numbers(_))
    }

    /// The number this value holds, None when it is not one.
    pub fn number(&self) -> Option<Number> {
        match self {
            Value::Number { text, integer: true, .. } => Some(if let Ok(v) = text.parse::<i64>() {
                Number::Int(v)
            } else if let Ok(v) = text.parse::<u64>() {
                Number::UInt(v)
            } else {
                Number::BigInt
            }),
            // The grammar was checked while parsing; an exponent too large reads as infinity.
            Value::Number { text, integer: false, .. } => Some(Number::Float(text.parse::<f64>().unwrap_or(f64::NAN))),
            Value::NonFinite(f) => Some(Number::Float(*f)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub offset: usize,
    pub what: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Parse error at offset {}: {}", self.offset, self.what)
    }
}

pub fn parse(bytes: &[u8]) -> Result<Value<'_>, ParseError> {
    // A JSON text is UTF-8 (RFC 8259 §8.1): checked once here, so every slice below is a str for free.
    let source = std::str::from_utf8(bytes)
        .map_err(|e| ParseError { offset: e.valid_up_to(), what: "Invalid encoding in string.".into() })?;
    let text = source.as_bytes();
    let mut parser = Parser { source, text, pos: 0 };
    parser.skip_ws();
    if parser.pos == text.len() {
        return Err(*parser.error("The document is empty."));
    }
    let value = parser.value(0).map_err(|e| *e)?;
    parser.skip_ws();
    if parser.pos != text.len() {
        return Err(*parser.error("The document root must not be followed by other values."));
    }
    Ok(value)
}

struct Parser<'a> {
    source: &'a str,
    text: &'a [u8],
    pos: usize,
}

/// A document with the byte spans (start, end) of the elements of one of its arrays.
pub type WithSpans<'t> = (Value<'t>, Option<Vec<(usize, usize)>>);

/// The document, and the byte span of each element of the array under the top-level key `key` (None
/// when the document has no such array): what lets a caller cut elements out of the text and keep the
/// others byte for byte.
pub fn parse_with_spans<'t>(bytes: &'t [u8], key: &str) -> Result<WithSpans<'t>, ParseError> {
    let doc = parse(bytes)?;
    let is_array = doc.get(key).is_some_and(Value::is_array);
    if !is_array {
        return Ok((doc, None));
    }
    // A second walk over text now known to be valid: only the top level and the one array.
    let source = std::str::from_utf8(bytes)
        .map_err(|e| ParseError { offset: e.valid_up_to(), what: "Invalid encoding in string.".into() })?;
    let mut parser = Parser { source, text: bytes, pos: 0 };
    let spans = parser.spans_under(key).map_err(|e| *e)?;
    Ok((doc, Some(spans)))
}

/// `text` with the pieces at `spans` (sorted, separated only by commas and white space) where `keep`
/// is false cut out, and the kept ones joined by commas: the elements of an array or the members of an
/// object removed from a document while every other byte stays as it was written.
pub fn splice(text: &[u8], spans: &[(usize, usize)], keep: &[bool]) -> Vec<u8> {
    let (Some(first), Some(last)) = (spans.first(), spans.last()) else {
        return text.to_vec();
    };
    let mut out = Vec::with_capacity(text.len());
    out.extend_from_slice(&text[..first.0]);
    let mut any = false;
    for (span, _) in spans.iter().zip(keep).filter(|(_, kept)| **kept) {
        if any {
            out.push(b',');
        }
        out.extend_from_slice(&text[span.0..span.1]);
        any = true;
    }
    out.extend_from_slice(&text[last.1..]);
    out
}

/// Errors are boxed inside the parser: a Result as small as its Value keeps the hot path lean.
type Parsed<T> = Result<T, Box<ParseError>>;

impl<'a> Parser<'a> {
    fn error(&self, what: &str) -> Box<ParseError> {
        Box::new(ParseError { offset: self.pos, what: what.to_owned() })
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    #[inline]
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &[u8], value: Value<'a>) -> Parsed<Value<'a>> {
        if self.text[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(self.error("Invalid value."))
        }
    }

    fn value(&mut self, depth: usize) -> Parsed<Value<'a>> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => Ok(Value::Str(self.string()?)),
            Some(b't') => self.literal(b"true", Value::Bool(true)),
            Some(b'f') => self.literal(b"false", Value::Bool(false)),
            Some(b'n') => self.literal(b"null", Value::Null),
            Some(b'N') => self.literal(b"NaN", Value::NonFinite(f64::NAN)),
            Some(b'I') => self.literal(b"Infinity", Value::NonFinite(f64::INFINITY)),
            Some(b'-') if self.text.get(self.pos + 1) == Some(&b'I') => {
                self.pos += 1;
                self.literal(b"Infinity", Value::NonFinite(f64::NEG_INFINITY))
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.error("Invalid value.")),
        }
    }

    fn object(&mut self, depth: usize) -> Parsed<Value<'a>> {
        if depth > MAX_DEPTH {
            return Err(self.error("The document is nested too deeply."));
        }
        self.pos += 1;
        let mut members: Vec<(Cow<'a, str>, Value<'a>)> = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.error("Missing a name for object member."));
            }
            let key_at = self.pos;
            let key = self.string()?;
            if members.iter().any(|(k, _)| *k == key) {
                return Err(Box::new(ParseError {
                    offset: key_at,
                    what: format!("duplicate key {key} in a JSON object"),
                }));
            }
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.error("Missing a colon after a name of object member."));
            }
            self.pos += 1;
            self.skip_ws();
            let value = self.value(depth)?;
            members.push((key, value));
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Value::Object(members));
                }
                _ => return Err(self.error("Missing a comma or '}' after an object member.")),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Parsed<Value<'a>> {
        if depth > MAX_DEPTH {
            return Err(self.error("The document is nested too deeply."));
        }
        let open = self.pos;
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        if self.starts_number() {
            if let Some(run) = self.numbers(open)? {
                return Ok(Value::Numbers(run));
            }
            self.pos = open + 1; // not numbers all through: read it element by element
            self.skip_ws();
        }
        loop {
            // Tensor data is long runs of numbers: they skip the general dispatch.
            let item = match self.peek() {
                Some(b'0'..=b'9') => self.number()?,
                Some(b'-') if self.text.get(self.pos + 1).is_some_and(u8::is_ascii_digit) => self.number()?,
                _ => {
                    self.skip_ws();
                    self.value(depth)?
                }
            };
            items.push(item);
            if self.peek() != Some(b',') {
                self.skip_ws();
            }
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.error("Missing a comma or ']' after an array element.")),
            }
        }
    }

    /// Spans of the elements of the array under top-level `key` (the text is known to be valid JSON).
    fn spans_under(&mut self, key: &str) -> Parsed<Vec<(usize, usize)>> {
        let mut spans = Vec::new();
        self.skip_ws();
        self.pos += 1; // '{'
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Ok(spans);
            }
            let name = self.string()?;
            self.skip_ws();
            self.pos += 1; // ':'
            self.skip_ws();
            if name == key && self.peek() == Some(b'[') {
                self.pos += 1;
                loop {
                    self.skip_ws();
                    if self.peek() == Some(b']') {
                        return Ok(spans);
                    }
                    let start = self.pos;
                    self.value(1)?;
                    spans.push((start, self.pos));
                    self.skip_ws();
                    if self.peek() == Some(b',') {
                        self.pos += 1;
                    }
                }
            }
            self.value(1)?;
            self.skip_ws();
            if self.peek() == Some(b',') {
                self.pos += 1;
            }
        }
    }

    fn starts_number(&self) -> bool {
        match self.peek() {
            Some(b'0'..=b'9') => true,
            Some(b'-') => self.text.get(self.pos + 1).is_some_and(u8::is_ascii_digit),
            _ => false,
        }
    }

    /// The array opened at `open` read as a run of numbers, or None (position undefined) when an
    /// element is not a number; a syntax error inside the run is reported as it would be otherwise.
    /// The position lives in a local while the run is read (a store to `self` per byte was a
    /// dependency chain through memory on every element).
    fn numbers(&mut self, open: usize) -> Parsed<Option<Numbers<'a>>> {
        let text = self.text;
        let mut run = Numbers {
            text: "",
            count: 0,
            any_float: false,
            any_negative: false,
            any_wide: false,
            below_exp10: i32::MIN,
        };
        let mut at = self.pos;
        loop {
            let negative = text.get(at) == Some(&b'-');
            if !text.get(at + usize::from(negative)).is_some_and(u8::is_ascii_digit) {
                return Ok(None);
            }
            let (end, integer, below_exp10) = self.scan_number_at(at)?;
            run.count += 1;
            run.any_float |= !integer;
            if integer {
                run.any_negative |= negative;
                run.any_wide |= end - at - usize::from(negative) > 18;
            }
            run.below_exp10 = run.below_exp10.max(below_exp10);
            at = skip_ws_at(text, end);
            match text.get(at) {
                Some(b',') => at = skip_ws_at(text, at + 1),
                Some(b']') => {
                    run.text = &self.source[open + 1..at];
                    self.pos = at + 1;
                    return Ok(Some(run));
                }
                _ => {
                    self.pos = at;
                    return Err(self.error("Missing a comma or ']' after an array element."));
                }
            }
        }
    }

    fn digits(&mut self) -> usize {
        let n = digit_run(self.text, self.pos);
        self.pos += n;
        n
    }

    fn number(&mut self) -> Parsed<Value<'a>> {
        let start = self.pos;
        let (end, integer, below_exp10) = self.scan_number_at(start)?;
        self.pos = end;
        Ok(Value::Number { text: &self.source[start..end], integer, below_exp10 })
    }

    /// One number from `at`: (where it ends, no fraction or exponent, its magnitude is below
    /// 10^this). Small enough to come back in registers: the run of a tensor's data builds no
    /// `Value` per element. On an error `self.pos` is where it was found.
    #[inline]
    fn scan_number_at(&mut self, at: usize) -> Parsed<(usize, bool, i32)> {
        // Written without branches on the data where it can be: signs and lengths of tensor data
        // are random, and a mispredicted branch per number was a third of a 1 MB body's time.
        let text = self.text;
        let int_start = at + usize::from(text.get(at) == Some(&b'-'));
        let n = digit_run(text, int_start);
        if n == 0 {
            self.pos = int_start;
            return Err(self.error("Invalid value."));
        }
        let leading_zero = text[int_start] == b'0';
        // "01" is the number 0 followed by a stray digit, which the caller refuses.
        let mut end = if leading_zero { int_start + 1 } else { int_start + n };
        // Digits of the integer part that count for the magnitude (a lone "0" counts none).
        let whole = if leading_zero { 0 } else { n as i64 };
        let mut integer = true;
        if text.get(end) == Some(&b'.') {
            integer = false;
            let fraction = digit_run(text, end + 1);
            end += 1;
            if fraction == 0 {
                self.pos = end;
                return Err(self.error("Missing fraction part in number."));
            }
            end += fraction;
        }
        let mut exponent: i64 = 0;
        if let Some(b'e' | b'E') = text.get(end) {
            integer = false;
            self.pos = end + 1;
            exponent = self.exponent()?;
            end = self.pos;
        }
        let below_exp10 = (whole + exponent).clamp(-2_000_000, 2_000_000) as i32;
        Ok((end, integer, below_exp10))
    }

    /// An exponent's sign and digits, from `self.pos` (past the `e`).
    fn exponent(&mut self) -> Parsed<i64> {
        let negative = match self.peek() {
            Some(b'-') => {
                self.pos += 1;
                true
            }
            Some(b'+') => {
                self.pos += 1;
                false
            }
            _ => false,
        };
        let at = self.pos;
        if self.digits() == 0 {
            return Err(self.error("Missing exponent in number."));
        }
        // Bounded: an exponent past 10^6 is infinity or zero to every datatype alike.
        let exponent = self.source[at..self.pos].parse::<i64>().unwrap_or(i64::MAX).min(1_000_000);
        Ok(if negative { -exponent } else { exponent })
    }

    fn string(&mut self) -> Parsed<Cow<'a, str>> {
        self.pos += 1; // the opening quote
        let start = self.pos;
        // The common case: no escape, so the bytes are the string (checked as UTF-8 once).
        loop {
            match self.peek() {
                None => return Err(self.error("Missing a closing quotation mark in string.")),
                Some(b'"') => {
                    let s = &self.source[start..self.pos];
                    self.pos += 1;
                    return Ok(Cow::Borrowed(s));
                }
                Some(b'\\') => break,
                Some(0..=0x1f) => return Err(self.error("Invalid encoding in string.")),
                Some(_) => self.pos += 1,
            }
        }
        let mut out: Vec<u8> = self.text[start..self.pos].to_vec();
        loop {
            match self.peek() {
                None => return Err(self.error("Missing a closing quotation mark in string.")),
                Some(b'"') => {
                    self.pos += 1;
                    return String::from_utf8(out).map(Cow::Owned).map_err(|e| {
                        Box::new(ParseError {
                            offset: start + e.utf8_error().valid_up_to(),
                            what: "Invalid encoding in string.".into(),
                        })
                    });
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let escaped = match self.peek() {
                        Some(b'"') => b'"',
                        Some(b'\\') => b'\\',
                        Some(b'/') => b'/',
                        Some(b'b') => 0x08,
                        Some(b'f') => 0x0c,
                        Some(b'n') => b'\n',
                        Some(b'r') => b'\r',
                        Some(b't') => b'\t',
                        Some(b'u') => {
                            self.pos += 1;
                            let c = self.unicode_escape()?;
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            continue;
                        }
                        _ => return Err(self.error("Invalid escape character in string.")),
                    };
                    out.push(escaped);
                    self.pos += 1;
                }
                Some(0..=0x1f) => return Err(self.error("Invalid encoding in string.")),
                Some(b) => {
                    out.push(b);
                    self.pos += 1;
                }
            }
        }
    }

    fn hex4(&mut self) -> Parsed<u32> {
        let digits = self
            .text
            .get(self.pos..self.pos + 4)
            .ok_or_else(|| self.error("Incorrect hex digit after \\u escape in string."))?;
        let mut v = 0u32;
        for &d in digits {
            let n = (d as char)
                .to_digit(16)
                .ok_or_else(|| self.error("Incorrect hex digit after \\u escape in string."))?;
            v = v * 16 + n;
        }
        self.pos += 4;
        Ok(v)
    }

    fn unicode_escape(&mut self) -> Parsed<char> {
        let first = self.hex4()?;
        let code = if (0xD800..0xDC00).contains(&first) {
            if self.text.get(self.pos..self.pos + 2) != Some(b"\\u") {
                return Err(self.error("The surrogate pair in string is invalid."));
            }
            self.pos += 2;
            let second = self.hex4()?;
            if !(0xDC00..0xE000).contains(&second) {
                return Err(self.error("The surrogate pair in string is invalid."));
            }
            0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
        } else {
            first
        };
        char::from_u32(code).ok_or_else(|| self.error("The surrogate pair in string is invalid."))
    }
}

/// Past the JSON white space at `at`.
#[inline]
fn skip_ws_at(text: &[u8], mut at: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = text.get(at) {
        at += 1;
    }
    at
}

/// How many ASCII digits `text` holds from `at` on. Eight bytes at a time, without a branch on the
/// data: tensor data's numbers have random lengths, and a byte loop mispredicted its exit once or
/// twice per number, which was half of a 1 MB body's time.
#[inline]
fn digit_run(text: &[u8], at: usize) -> usize {
    let mut n = 0;
    while let Some(chunk) = text.get(at + n..at + n + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let stop = non_digits(u64::from_le_bytes(word));
        if stop != 0 {
            return n + (stop.trailing_zeros() / 8) as usize;
        }
        n += 8;
    }
    n + text.get(at + n..).unwrap_or_default().iter().take_while(|b| b.is_ascii_digit()).count()
}

/// The high bit of each byte of `word` that is not an ASCII digit. Per byte, with no carry between
/// bytes: x = b & 0x7f; x + 0x46 reaches 0x80 when x > b'9'; x + 0x50 stays below 0x80 when
/// x < b'0'; and b's own high bit marks a byte above 0x7f.
#[inline]
fn non_digits(word: u64) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let x = word & LOW7;
    let above_nine = x + 0x4646_4646_4646_4646;
    let from_zero = x + 0x5050_5050_5050_5050;
    (above_nine | !from_zero | word) & HIGH
}

#[cfg(test)]
mod tests {
    #[test]
    fn digit_runs_are_counted_as_a_byte_loop_counts_them() {
        for b in 0u8..=255 {
            let word = u64::from_le_bytes([b; 8]);
            assert_eq!(super::non_digits(word) != 0, !b.is_ascii_digit(), "byte {b}");
        }
        for text in ["", "1", "12345678", "123456789", "1234567,", "0.5", "12345678901234567890]", "-1", "9\u{ff}"] {
            let bytes = text.as_bytes();
            for at in 0..=bytes.len() {
                let expected = bytes[at..].iter().take_while(|b| b.is_ascii_digit()).count();
                assert_eq!(super::digit_run(bytes, at), expected, "{text:?} at {at}");
            }
        }
    }

    use super::*;

    #[test]
    fn numbers_keep_their_kind() {
        let v = parse(br#"[1, -2, 18446744073709551615, 99999999999999999999999, 1.5, 1e3, -0]"#).unwrap();
        let Value::Numbers(run) = &v else { panic!("not a run of numbers: {v:?}") };
        assert_eq!(
            (run.count, run.any_float, run.any_negative, run.any_wide, run.below_exp10),
            (7, true, true, true, 23)
        );
        let items = v.items().unwrap();
        let numbers: Vec<Option<Number>> = items.iter().map(Value::number).collect();
        assert_eq!(
            numbers,
            vec![
                Some(Number::Int(1)),
                Some(Number::Int(-2)),
                Some(Number::UInt(u64::MAX)),
                Some(Number::BigInt),
                Some(Number::Float(1.5)),
                Some(Number::Float(1000.0)),
                Some(Number::Int(0)),
            ]
        );
    }

    #[test]
    fn nan_and_infinity_literals_are_read_as_triton_reads_them() {
        let Value::Array(v) = parse(b"[NaN, Infinity, -Infinity]").unwrap() else { panic!("not an array") };
        let mixed = parse(b"[1, 2, NaN]").unwrap();
        assert!(matches!(&mixed, Value::Array(items) if items.len() == 3), "{mixed:?}");
        assert!(parse(b"[1, 2,]").is_err() && parse(b"[1 2]").is_err() && parse(b"[1, -]").is_err());
        assert!(matches!(v[0].number(), Some(Number::Float(f)) if f.is_nan()));
        assert_eq!(v[1].number(), Some(Number::Float(f64::INFINITY)));
        assert_eq!(v[2].number(), Some(Number::Float(f64::NEG_INFINITY)));
    }

    #[test]
    fn a_key_twice_is_refused() {
        let e = parse(br#"{"inputs": [], "inputs": []}"#).unwrap_err();
        assert!(e.what.contains("duplicate key inputs"), "{e}");
    }

    #[test]
    fn escapes_and_unicode() {
        assert_eq!(parse(br#""a\n\u00e9\ud83d\ude00\"""#).unwrap(), Value::Str("a\n\u{e9}\u{1F600}\"".into()));
        assert!(matches!(parse(br#""plain""#).unwrap(), Value::Str(Cow::Borrowed("plain"))));
        assert!(parse(br#""\ud83d""#).is_err());
        assert!(parse(b"\"\xff\"").is_err());
        assert!(parse(b"\"a\x01\"").is_err());
    }

    #[test]
    fn broken_documents_say_where() {
        for bad in [&b"{not json"[..], b"", b"[1,]", b"[1] 2", b"01", b"1.", b"-", b"tru", b"{\"a\" 1}"] {
            assert!(parse(bad).is_err(), "{:?} parsed", String::from_utf8_lossy(bad));
        }
        assert_eq!(parse(b"{not json").unwrap_err().offset, 1);
    }

    #[test]
    fn spans_cut_elements_out_byte_for_byte() {
        let text = br#"{"model_name":"m","outputs":[{"name":"a","data":[1]}, {"name":"b"} ,{"name":"c"}]}"#;
        let (_, spans) = parse_with_spans(text, "outputs").unwrap();
        let spans = spans.unwrap();
        let pieces: Vec<&[u8]> = spans.iter().map(|(s, e)| &text[*s..*e]).collect();
        assert_eq!(pieces, vec![&br#"{"name":"a","data":[1]}"#[..], br#"{"name":"b"}"#, br#"{"name":"c"}"#]);
        assert!(parse_with_spans(b"{\"outputs\": 1}", "outputs").unwrap().1.is_none());
    }

    #[test]
    fn depth_is_bounded() {
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert!(parse(deep.as_bytes()).unwrap_err().what.contains("nested too deeply"));
        let fine = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(parse(fine.as_bytes()).is_ok());
    }
}
