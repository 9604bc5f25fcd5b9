//! Server-sent events as Triton's generate_stream writes them (sidecar/protocol/sse.py): the stream
//! cut into events as it arrives, each as soon as its blank line is here, and written out again.

use bytes::{Bytes, BytesMut};

/// Server-sent events out of a byte stream, each as soon as its blank line arrives. The rules are
/// sidecar.protocol.sse.EventSplitter's, so either front relays the same events: CRLF read as LF
/// (also when a CR and its LF come in two reads), comment-only events skipped, the `data:` lines of
/// one event joined with LF.
#[derive(Default)]
pub struct EventSplitter {
    /// What the last reads left after their last complete event.
    buffer: BytesMut,
}

impl EventSplitter {
    /// The `data` of every event `chunk` completed, in order.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<Bytes> {
        // Scanning resumes at the old bytes' last byte (a blank line may begin there), or from the
        // start when CRLFs were rewritten.
        let mut scan = self.buffer.len().saturating_sub(1);
        self.buffer.extend_from_slice(chunk);
        if self.buffer.contains(&b'\r') {
            self.buffer = BytesMut::from(&replace_crlf(&self.buffer)[..]);
            scan = 0;
        }
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(found) = find_blank_line(&self.buffer[scan..]) {
            let end = scan + found;
            if let Some(data) = event_data(&self.buffer[start..end]) {
                events.push(data);
            }
            start = end + 2;
            scan = start;
        }
        let _ = self.buffer.split_to(start);
        events
    }

    /// Bytes of an event that has not ended (a stream cut off mid-event); whitespace alone is not one.
    pub fn pending(&self) -> bool {
        self.buffer.iter().any(|b| !b" \t\n\r\x0b\x0c".contains(b))
    }
}

fn replace_crlf(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i] == b'\r' && text.get(i + 1) == Some(&b'\n') {
            out.push(b'\n');
            i += 2;
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

fn find_blank_line(text: &[u8]) -> Option<usize> {
    text.windows(2).position(|w| w == b"\n\n")
}

/// The data of one event's block; None for an event without data (comments only).
fn event_data(block: &[u8]) -> Option<Bytes> {
    if let Some(data) = block.strip_prefix(b"data: ") {
        if !block.contains(&b'\n') {
            return Some(Bytes::copy_from_slice(data)); // the one-line event Triton writes
        }
    }
    let lines: Vec<&[u8]> = block
        .split(|&b| b == b'\n')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(|rest| {
            let spaces = rest.iter().take_while(|&&b| b == b' ').count();
            &rest[spaces..]
        })
        .collect();
    if lines.is_empty() {
        return None;
    }
    Some(Bytes::from(lines.join(&b'\n')))
}

/// One event as the sidecar writes it to its client (sidecar.protocol.sse.sse_event).
pub fn write_event(data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(splitter: &mut EventSplitter, chunks: &[&[u8]]) -> Vec<Bytes> {
        chunks.iter().flat_map(|c| splitter.feed(c)).collect()
    }

    #[test]
    fn events_are_cut_as_soon_as_their_blank_line_arrives() {
        // tests/test_generation.py's case, the Python splitter's.
        let mut splitter = EventSplitter::default();
        assert_eq!(splitter.feed(b"data: {\"a\": 1}\n\ndata: {\"b\""), vec![Bytes::from_static(b"{\"a\": 1}")]);
        assert!(splitter.pending());
        assert_eq!(splitter.feed(b": 2}\r\n\r\n: a comment\n\n"), vec![Bytes::from_static(b"{\"b\": 2}")]);
        assert!(!splitter.pending());
        assert_eq!(
            splitter.feed(b"data: line one\ndata: line two\n\n"),
            vec![Bytes::from_static(b"line one\nline two")]
        );
    }

    #[test]
    fn a_stream_split_at_any_byte_gives_the_same_events() {
        let whole: &[u8] = b"data: {\"text_output\":\"a\"}\n\ndata: {\"text_output\":\" b\"}\r\n\r\n: keep-alive\n\n\
                             data:   {\"x\": 1}\ndata:y\n\ndata: {\"text_output\":\" c\"}\n\n";
        let expected: Vec<Bytes> = vec![
            Bytes::from_static(b"{\"text_output\":\"a\"}"),
            Bytes::from_static(b"{\"text_output\":\" b\"}"),
            Bytes::from_static(b"{\"x\": 1}\ny"),
            Bytes::from_static(b"{\"text_output\":\" c\"}"),
        ];
        assert_eq!(all(&mut EventSplitter::default(), &[whole]), expected);
        for first in 0..whole.len() {
            for second in first..whole.len() {
                let mut splitter = EventSplitter::default();
                let events = all(&mut splitter, &[&whole[..first], &whole[first..second], &whole[second..]]);
                assert_eq!(events, expected, "split at {first} and {second}");
                assert!(!splitter.pending());
            }
        }
    }

    #[test]
    fn a_stream_fed_byte_by_byte_gives_each_event_on_its_last_byte() {
        let whole: &[u8] = b"data: 1\r\n\r\ndata: 2\n\n";
        let mut splitter = EventSplitter::default();
        let mut seen = Vec::new();
        for (i, byte) in whole.iter().enumerate() {
            for event in splitter.feed(&[*byte]) {
                seen.push((i, event));
            }
        }
        assert_eq!(seen, vec![(10, Bytes::from_static(b"1")), (19, Bytes::from_static(b"2"))]);
    }

    #[test]
    fn a_cut_off_event_is_pending_and_whitespace_is_not() {
        let mut splitter = EventSplitter::default();
        assert!(splitter.feed(b"data: {\"a\"").is_empty());
        assert!(splitter.pending());
        let mut splitter = EventSplitter::default();
        assert!(splitter.feed(b"data: x\n\n \r\n").len() == 1);
        assert!(!splitter.pending());
    }

    #[test]
    fn events_are_written_as_triton_s_one_line_events() {
        let mut out = Vec::new();
        write_event(b"{\"a\":1}", &mut out);
        assert_eq!(out, b"data: {\"a\":1}\n\n");
    }
}
