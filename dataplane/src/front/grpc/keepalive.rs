//! Keepalive enforcement on listen.grpc_port (`listen.grpc_min_ping_interval_s`): gRPC core's ping
//! policy, which hyper's HTTP/2 server does not have (h2 acknowledges every PING, and neither hyper
//! nor h2 offers a hook on received PINGs or a way to send GOAWAY with debug data).
//!
//! The policy, as gRPC core's `Chttp2PingAbusePolicy` (the grpcio front ran it with
//! `grpc.http2.max_ping_strikes` 2 and `grpc.keepalive_permit_without_calls` 0): a PING that comes
//! sooner than the minimum interval after the previous one is a strike (the interval is two hours
//! while the connection has no call open); a strike past `MAX_PING_STRIKES` ends the connection. What
//! the server sends (HEADERS, DATA, a connection WINDOW_UPDATE) forgives: the strikes and the clock
//! start again, as gRPC core's `grpc_chttp2_reset_ping_clock` on each of those writes. What the
//! client sends never does.
//!
//! `Policed` wraps a connection's byte stream between TLS (when on) and hyper. It reads the HTTP/2
//! frame headers going both ways without holding any payload back (the client preface, then 9-byte
//! frame headers; a payload is skipped by its length, except a SETTINGS frame's few parameters), so
//! a read or a write costs a few comparisons per frame. When a client has pinged too often it
//! writes, at the next frame boundary outside a header block, what grpcio wrote: GOAWAY
//! (ENHANCE_YOUR_CALM, last stream id the highest the client opened, debug data "too_many_pings",
//! which gRPC clients log and answer by doubling their keepalive time), then for each call still
//! open trailers UNAVAILABLE "Too many pings" and RST_STREAM NO_ERROR; it then closes its write side
//! and drains what the client still sends for a bounded time (so the kernel does not reset the
//! connection and drop the farewell before the client has read it), and ends hyper's connection.
//! Malformed frames are hyper's to refuse: this layer only counts, never refuses, never panics.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// Strikes forgiven before the connection ends: gRPC core's default `grpc.http2.max_ping_strikes`,
/// the value the grpcio front set.
pub const MAX_PING_STRIKES: u32 = 2;

/// The shortest interval between PINGs while the connection has no call open: gRPC core's with
/// `grpc.keepalive_permit_without_calls` 0 (the grpcio front's), RFC 1122's two hours for TCP
/// keep-alive.
pub const IDLE_PING_INTERVAL: Duration = Duration::from_secs(2 * 60 * 60);

/// After the farewell, how long the client's bytes are read and thrown away before the connection
/// closes (a gRPC client closes at once once its calls have ended).
pub const LINGER: Duration = Duration::from_secs(1);

/// ...and how many bytes at most.
const LINGER_MAX_BYTES: usize = 1 << 20;

/// The grpc-message of the calls a too-many-pings GOAWAY ends (grpcio's, what clients show).
pub const TOO_MANY_PINGS: &str = "Too many pings";

/// Client streams remembered for the farewell's trailers; h2 keeps fewer open
/// (listen.grpc_max_concurrent_streams), so only a client past that bound goes without trailers.
const MAX_TRACKED_STREAMS: usize = 1024;

const PREFACE_LEN: usize = 24;
const HEADER_LEN: usize = 9;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

const NO_ERROR: u32 = 0x0;
const ENHANCE_YOUR_CALM: u32 = 0xb;
const SETTINGS_HEADER_TABLE_SIZE: u16 = 0x1;
/// HPACK's default dynamic table size (RFC 7541 §4.2), in force until the client's SETTINGS says less.
const DEFAULT_TABLE_SIZE: u32 = 4096;

/// listen.grpc_min_ping_interval_s and the strikes forgiven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PingPolicy {
    pub min_interval: Duration,
    pub max_strikes: u32,
}

impl PingPolicy {
    pub fn new(min_interval: Duration) -> Self {
        PingPolicy { min_interval, max_strikes: MAX_PING_STRIKES }
    }
}

/// One connection's strikes and the time of the client's last PING.
#[derive(Debug, Default)]
struct Strikes {
    last: Option<Instant>,
    count: u32,
}

impl Strikes {
    /// A PING (not an ack) at `now`, `idle` when no call is open: true when it is one strike too many.
    fn ping(&mut self, policy: &PingPolicy, now: Instant, idle: bool) -> bool {
        let interval = if idle { IDLE_PING_INTERVAL } else { policy.min_interval };
        let early = self.last.is_some_and(|last| now.saturating_duration_since(last) < interval);
        self.last = Some(now);
        if !early {
            return false;
        }
        self.count = self.count.saturating_add(1);
        policy.max_strikes != 0 && self.count > policy.max_strikes
    }

    fn forgive(&mut self) {
        *self = Strikes::default();
    }
}

/// A frame's 9-byte header, read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Head {
    len: usize,
    kind: u8,
    flags: u8,
    stream: u32,
}

/// One direction's frame boundaries, fed the bytes as they pass in any pieces.
#[derive(Debug)]
struct Frames {
    /// Bytes of the client preface still to skip (inbound only).
    preface: usize,
    head: [u8; HEADER_LEN],
    head_len: usize,
    /// The frame whose payload is passing, and how much of it is still to come.
    current: Option<Head>,
    payload_left: usize,
    seen_any: bool,
}

impl Frames {
    fn new(preface: usize) -> Self {
        Frames { preface, head: [0; HEADER_LEN], head_len: 0, current: None, payload_left: 0, seen_any: false }
    }

    /// Between two frames (and past the preface).
    fn at_boundary(&self) -> bool {
        self.preface == 0 && self.head_len == 0 && self.payload_left == 0
    }

    /// How many bytes may pass before the next boundary: the rest of the preface, of a header or of
    /// a payload; at a boundary, the next frame's header.
    fn to_boundary(&self) -> usize {
        if self.preface > 0 {
            self.preface
        } else if self.head_len > 0 {
            HEADER_LEN - self.head_len
        } else if self.payload_left > 0 {
            self.payload_left
        } else {
            HEADER_LEN
        }
    }

    /// Feed the next bytes; `on` is told of each frame header once whole (`Seen::Head`, with where
    /// in `bytes` it ends) and of each piece of its payload (`Seen::Payload`).
    fn feed(&mut self, mut bytes: &[u8], on: &mut impl FnMut(Seen<'_>)) {
        let total = bytes.len();
        while !bytes.is_empty() {
            if self.preface > 0 {
                let skip = self.preface.min(bytes.len());
                self.preface -= skip;
                bytes = &bytes[skip..];
            } else if self.payload_left > 0 {
                let take = self.payload_left.min(bytes.len());
                if let Some(head) = self.current {
                    on(Seen::Payload(head, &bytes[..take]));
                }
                self.payload_left -= take;
                bytes = &bytes[take..];
            } else {
                let take = (HEADER_LEN - self.head_len).min(bytes.len());
                self.head[self.head_len..self.head_len + take].copy_from_slice(&bytes[..take]);
                self.head_len += take;
                bytes = &bytes[take..];
                if self.head_len == HEADER_LEN {
                    self.head_len = 0;
                    let h = self.head;
                    let head = Head {
                        len: (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]),
                        kind: h[3],
                        flags: h[4],
                        stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
                    };
                    self.current = Some(head);
                    self.payload_left = head.len;
                    self.seen_any = true;
                    on(Seen::Head(head, total - bytes.len()));
                }
            }
        }
    }
}

enum Seen<'a> {
    Head(Head, usize),
    Payload(Head, &'a [u8]),
}

/// A call the client opened that the server has not ended: its stream, and whether its response
/// headers went out (then its farewell is trailers alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OpenStream {
    id: u32,
    answered: bool,
}

/// What one connection's frames tell the policy (no I/O: `Policed` feeds it).
#[derive(Debug)]
pub struct Watch {
    policy: PingPolicy,
    inbound: Frames,
    outbound: Frames,
    strikes: Strikes,
    streams: Vec<OpenStream>,
    last_stream: u32,
    /// The server is inside a header block (HEADERS without END_HEADERS, then CONTINUATION): no
    /// other frame may come between.
    header_block: bool,
    /// The smallest SETTINGS_HEADER_TABLE_SIZE the client announced below HPACK's default: the
    /// farewell's first header block starts with a table size update to it (RFC 7541 §4.2), so it
    /// is right whether or not h2's encoder has sent its own yet.
    table_size: Option<u32>,
    /// A SETTINGS parameter split across reads.
    param: [u8; 6],
    param_len: usize,
    too_many: bool,
}

impl Watch {
    pub fn new(policy: PingPolicy) -> Self {
        Watch {
            policy,
            inbound: Frames::new(PREFACE_LEN),
            outbound: Frames::new(0),
            strikes: Strikes::default(),
            streams: Vec::new(),
            last_stream: 0,
            header_block: false,
            table_size: None,
            param: [0; 6],
            param_len: 0,
            too_many: false,
        }
    }

    /// The client pinged past the policy: the connection is to end.
    pub fn too_many_pings(&self) -> bool {
        self.too_many
    }

    /// The farewell may go out now: the client pinged too often, and the server's bytes are at a
    /// frame boundary outside a header block, after its own SETTINGS.
    pub fn farewell_due(&self) -> bool {
        self.too_many && self.outbound.seen_any && self.outbound.at_boundary() && !self.header_block
    }

    /// How many of the server's next bytes may go before the farewell's place (a frame boundary).
    fn outbound_step(&self) -> usize {
        self.outbound.to_boundary()
    }

    /// Bytes read from the client at `now`. When they hold the PING that was one too many: how many
    /// of them came before it (the rest are not for hyper: grpcio does not acknowledge that PING
    /// either, nor read on).
    pub fn read(&mut self, bytes: &[u8], now: Instant) -> Option<usize> {
        let Watch { policy, inbound, strikes, streams, last_stream, table_size, param, param_len, too_many, .. } = self;
        let mut tripped = None;
        inbound.feed(bytes, &mut |seen| match seen {
            Seen::Head(head, end) => match head.kind {
                PING if head.flags & ACK == 0 && !*too_many => {
                    // No call open: no stream the client opened that the server has not ended or
                    // either side reset (gRPC core's empty stream map).
                    *too_many = strikes.ping(policy, now, streams.is_empty());
                    if *too_many {
                        tripped = Some(end.saturating_sub(HEADER_LEN));
                    }
                }
                HEADERS if head.stream > *last_stream && head.stream % 2 == 1 => {
                    *last_stream = head.stream;
                    if streams.len() < MAX_TRACKED_STREAMS {
                        streams.push(OpenStream { id: head.stream, answered: false });
                    }
                }
                RST_STREAM => streams.retain(|s| s.id != head.stream),
                SETTINGS => *param_len = 0,
                _ => {}
            },
            Seen::Payload(head, mut piece) if head.kind == SETTINGS && head.flags & ACK == 0 => {
                // Parameters are 6 bytes: 2 of identifier, 4 of value.
                while !piece.is_empty() {
                    let take = (param.len() - *param_len).min(piece.len());
                    param[*param_len..*param_len + take].copy_from_slice(&piece[..take]);
                    *param_len += take;
                    piece = &piece[take..];
                    if *param_len == param.len() {
                        *param_len = 0;
                        let id = u16::from_be_bytes([param[0], param[1]]);
                        let value = u32::from_be_bytes([param[2], param[3], param[4], param[5]]);
                        if id == SETTINGS_HEADER_TABLE_SIZE && value < DEFAULT_TABLE_SIZE {
                            *table_size = Some(table_size.map_or(value, |t| t.min(value)));
                        }
                    }
                }
            }
            Seen::Payload(..) => {}
        });
        tripped
    }

    /// Bytes the server wrote.
    pub fn wrote(&mut self, bytes: &[u8]) {
        let Watch { outbound, strikes, streams, header_block, .. } = self;
        outbound.feed(bytes, &mut |seen| {
            let Seen::Head(head, _) = seen else { return };
            match head.kind {
                HEADERS | DATA => {
                    strikes.forgive();
                    if head.kind == HEADERS {
                        *header_block = head.flags & END_HEADERS == 0;
                    }
                    if head.flags & END_STREAM != 0 {
                        streams.retain(|s| s.id != head.stream);
                    } else if head.kind == HEADERS {
                        if let Some(stream) = streams.iter_mut().find(|s| s.id == head.stream) {
                            stream.answered = true;
                        }
                    }
                }
                // CONTINUATION (0x9): the header block goes on until END_HEADERS.
                0x9 => *header_block = head.flags & END_HEADERS == 0,
                WINDOW_UPDATE if head.stream == 0 => strikes.forgive(),
                RST_STREAM => streams.retain(|s| s.id != head.stream),
                _ => {}
            }
        });
    }

    /// What grpcio writes to a client that pinged too often: GOAWAY, then for each call still open
    /// its trailers (UNAVAILABLE, "Too many pings") and RST_STREAM NO_ERROR.
    pub fn farewell(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.streams.len() * 96);
        let debug = b"too_many_pings";
        frame_head(&mut out, 8 + debug.len(), GOAWAY, 0, 0);
        out.extend_from_slice(&self.last_stream.to_be_bytes());
        out.extend_from_slice(&ENHANCE_YOUR_CALM.to_be_bytes());
        out.extend_from_slice(debug);
        let mut table_size = self.table_size;
        let status = UNAVAILABLE_NUMBER.to_string();
        for stream in &self.streams {
            let mut block = Vec::with_capacity(80);
            if let Some(size) = table_size.take() {
                hpack_int(&mut block, 5, 0x20, size as usize);
            }
            if !stream.answered {
                block.push(0x88); // :status 200, the static table's entry 8
                literal(&mut block, "content-type", super::wire::CONTENT_TYPE);
            }
            literal(&mut block, "grpc-status", &status);
            literal(&mut block, "grpc-message", TOO_MANY_PINGS);
            frame_head(&mut out, block.len(), HEADERS, END_STREAM | END_HEADERS, stream.id);
            out.extend_from_slice(&block);
            frame_head(&mut out, 4, RST_STREAM, 0, stream.id);
            out.extend_from_slice(&NO_ERROR.to_be_bytes());
        }
        out
    }
}

/// grpc-status UNAVAILABLE, what gRPC core's "Too many pings" close gives the calls it ends.
const UNAVAILABLE_NUMBER: u8 = super::wire::UNAVAILABLE.0;

fn frame_head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = len as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
}

/// An HPACK integer (RFC 7541 §5.1) with a `prefix`-bit prefix after the `pattern` bits.
fn hpack_int(out: &mut Vec<u8>, prefix: u32, pattern: u8, value: usize) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(pattern | value as u8);
        return;
    }
    out.push(pattern | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A header field as a literal without indexing, its name new (RFC 7541 §6.2.2): it neither uses
/// nor changes the dynamic table h2's encoder keeps, so it decodes right wherever it falls.
fn literal(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0x00);
    hpack_int(out, 7, 0x00, name.len());
    out.extend_from_slice(name.as_bytes());
    hpack_int(out, 7, 0x00, value.len());
    out.extend_from_slice(value.as_bytes());
}

enum State {
    Serving,
    /// The farewell going out, then flushed, then the write side closed.
    Farewell {
        bytes: Vec<u8>,
        sent: usize,
        flushed: bool,
    },
    /// Reading and throwing away what the client still sends, until it closes or the bound.
    Lingering {
        until: Pin<Box<Sleep>>,
        drained: usize,
    },
    /// hyper reads end of stream; what it writes goes nowhere.
    Closed,
}

/// A connection's byte stream under the ping policy (see the module's comment).
pub struct Policed<S> {
    io: S,
    watch: Watch,
    state: State,
}

impl<S> Policed<S> {
    pub fn new(io: S, policy: PingPolicy) -> Self {
        Policed { io, watch: Watch::new(policy), state: State::Serving }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Policed<S> {
    /// Move on from Serving when the farewell is due, and the farewell as far as it goes:
    /// Ready once it is written, flushed and the write side closed (the state then Lingering).
    fn poll_farewell(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if matches!(self.state, State::Serving) {
            if !self.watch.farewell_due() {
                return Poll::Ready(());
            }
            self.state = State::Farewell { bytes: self.watch.farewell(), sent: 0, flushed: false };
        }
        let State::Farewell { bytes, sent, flushed } = &mut self.state else { return Poll::Ready(()) };
        while *sent < bytes.len() {
            match Pin::new(&mut self.io).poll_write(cx, &bytes[*sent..]) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => {
                    self.state = State::Closed;
                    return Poll::Ready(());
                }
                Poll::Ready(Ok(n)) => *sent += n,
                Poll::Pending => return Poll::Pending,
            }
        }
        if !*flushed {
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => *flushed = true,
                Poll::Ready(Err(_)) => {
                    self.state = State::Closed;
                    return Poll::Ready(());
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        match Pin::new(&mut self.io).poll_shutdown(cx) {
            Poll::Ready(Ok(())) => {
                self.state = State::Lingering { until: Box::pin(tokio::time::sleep(LINGER)), drained: 0 };
            }
            Poll::Ready(Err(_)) => self.state = State::Closed,
            Poll::Pending => return Poll::Pending,
        }
        Poll::Ready(())
    }

    /// Lingering: read and drop the client's bytes until it closes, LINGER or LINGER_MAX_BYTES.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let State::Lingering { until, drained } = &mut self.state else { return Poll::Ready(()) };
        if until.as_mut().poll(cx).is_ready() {
            self.state = State::Closed;
            return Poll::Ready(());
        }
        let mut scratch = [0u8; 4096];
        for _ in 0..16 {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() && *drained < LINGER_MAX_BYTES => {
                    *drained += buf.filled().len();
                }
                Poll::Ready(_) => {
                    self.state = State::Closed;
                    return Poll::Ready(());
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        // A client still sending: give the runtime back and come again.
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// The bytes of a write as far as the policy lets them go before the farewell's place.
    fn allowed(&self, len: usize) -> usize {
        if self.watch.too_many_pings() {
            len.min(self.watch.outbound_step())
        } else {
            len
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Policed<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            match this.state {
                State::Serving if this.watch.farewell_due() => {}
                State::Serving => {
                    let before = buf.filled().len();
                    std::task::ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
                    if let Some(kept) = this.watch.read(&buf.filled()[before..], Instant::now()) {
                        buf.set_filled(before + kept);
                        if kept == 0 {
                            // Nothing for hyper (an empty read would be its end of stream): on to
                            // the farewell.
                            continue;
                        }
                    }
                    // What came before the PING goes to hyper; the farewell at the next read.
                    return Poll::Ready(Ok(()));
                }
                State::Farewell { .. } => {}
                State::Lingering { .. } => {
                    std::task::ready!(this.poll_linger(cx));
                    continue;
                }
                State::Closed => return Poll::Ready(Ok(())),
            }
            std::task::ready!(this.poll_farewell(cx));
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Policed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        std::task::ready!(this.poll_farewell(cx));
        if !matches!(this.state, State::Serving) {
            // The connection is ending: hyper's frames after the farewell go nowhere.
            return Poll::Ready(Ok(buf.len()));
        }
        let allowed = this.allowed(buf.len());
        let n = std::task::ready!(Pin::new(&mut this.io).poll_write(cx, &buf[..allowed]))?;
        this.watch.wrote(&buf[..n.min(allowed)]);
        if this.watch.farewell_due() {
            // Its place has come: make sure the task comes back to send it even if hyper has
            // nothing more to write.
            cx.waker().wake_by_ref();
        }
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if !matches!(this.state, State::Serving) || this.watch.too_many_pings() {
            // Ending, or a write to cut at a frame boundary: one slice at a time.
            let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &b[..]);
            return Pin::new(this).poll_write(cx, first);
        }
        let n = std::task::ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs))?;
        let mut left = n;
        for slice in bufs {
            if left == 0 {
                break;
            }
            let take = left.min(slice.len());
            this.watch.wrote(&slice[..take]);
            left -= take;
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        std::task::ready!(this.poll_farewell(cx));
        match this.state {
            State::Serving => Pin::new(&mut this.io).poll_flush(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        std::task::ready!(this.poll_farewell(cx));
        match this.state {
            State::Serving => Pin::new(&mut this.io).poll_shutdown(cx),
            _ => Poll::Ready(Ok(())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const SECOND: Duration = Duration::from_secs(1);

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        frame_head(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out
    }

    fn ping(ack: bool) -> Vec<u8> {
        frame(PING, if ack { ACK } else { 0 }, 0, &[7; 8])
    }

    /// The server's side as h2 starts it: SETTINGS, a connection WINDOW_UPDATE.
    fn server_start(watch: &mut Watch) {
        watch.wrote(&frame(SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 100]));
        watch.wrote(&frame(WINDOW_UPDATE, 0, 0, &[0, 0x1f, 0, 0]));
    }

    /// A policy of 10 s; every ping 100 ms after the last, one call open.
    fn policy() -> PingPolicy {
        PingPolicy::new(Duration::from_secs(10))
    }

    #[test]
    fn early_pings_are_strikes_and_the_third_is_one_too_many() {
        let (policy, start) = (policy(), Instant::now());
        let mut strikes = Strikes::default();
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert!(!strikes.ping(&policy, at(0), false), "the first ping is free");
        assert!(!strikes.ping(&policy, at(100), false)); // strike 1
        assert!(!strikes.ping(&policy, at(200), false)); // strike 2
        assert!(strikes.ping(&policy, at(300), false), "strike 3 of 2 allowed");
    }

    #[test]
    fn pings_at_the_interval_are_no_strike_and_the_server_speaking_forgives() {
        let (policy, start) = (policy(), Instant::now());
        let mut strikes = Strikes::default();
        for i in 0..10 {
            assert!(!strikes.ping(&policy, start + 10 * SECOND * i, false));
        }
        assert_eq!(strikes.count, 0);
        for i in 0..20 {
            // Two early pings, then the server sends something: never past the bound.
            assert!(!strikes.ping(&policy, start + Duration::from_millis(100 * i), false));
            if i % 2 == 1 {
                strikes.forgive();
            }
        }
    }

    #[test]
    fn without_a_call_open_the_interval_is_two_hours_and_zero_strikes_means_no_bound() {
        let start = Instant::now();
        let mut strikes = Strikes::default();
        let lax = PingPolicy::new(Duration::ZERO);
        for i in 0..10 {
            assert!(!strikes.ping(&lax, start + SECOND * i, false), "0 s: any interval with a call open");
        }
        let mut idle = Strikes::default();
        let verdicts: Vec<bool> = (0..4).map(|i| idle.ping(&lax, start + 3600 * SECOND * i, true)).collect();
        assert_eq!(verdicts, [false, false, false, true], "hourly pings with no call: strikes");
        let mut unbounded = Strikes::default();
        let never = PingPolicy { min_interval: Duration::from_secs(10), max_strikes: 0 };
        assert!((0..50).all(|i| !unbounded.ping(&never, start + Duration::from_millis(i), false)));
    }

    /// A client's bytes: preface, SETTINGS (a smaller HPACK table), WINDOW_UPDATE, a call (HEADERS,
    /// a big DATA whose payload is full of PING-looking bytes), acks, then pings 100 ms apart.
    fn client_bytes() -> (Vec<u8>, Vec<usize>) {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(SETTINGS, 0, 0, &[0, 1, 0, 0, 2, 0, 0, 4, 0, 0x40, 0, 0]));
        bytes.extend(frame(WINDOW_UPDATE, 0, 0, &[0, 0x3f, 0, 1]));
        bytes.extend(frame(HEADERS, END_HEADERS, 1, &[0x83, 0x86]));
        let fake_pings: Vec<u8> = (0..70_000 / 17).flat_map(|_| ping(false)).collect();
        bytes.extend(frame(DATA, 0, 1, &fake_pings));
        for _ in 0..5 {
            bytes.extend(ping(true));
            bytes.extend(frame(SETTINGS, ACK, 0, &[]));
        }
        let mut pings = Vec::new();
        for _ in 0..4 {
            bytes.extend(frame(WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]));
            bytes.extend(frame(SETTINGS, 0, 0, &[0, 4, 0, 0, 0x10, 0]));
            bytes.extend(ping(false));
            pings.push(bytes.len());
        }
        (bytes, pings)
    }

    /// Feed `bytes` in pieces cut at `cuts`, each ping frame's end 100 ms after the one before.
    fn feed(bytes: &[u8], cuts: &[usize], pings: &[usize]) -> Watch {
        let mut watch = Watch::new(policy());
        server_start(&mut watch);
        let start = Instant::now();
        let mut from = 0;
        for &to in cuts.iter().chain(std::iter::once(&bytes.len())) {
            // Time is the count of pings wholly read so far, 100 ms each.
            let done = pings.iter().filter(|&&end| end <= to).count() as u64;
            watch.read(&bytes[from..to], start + Duration::from_millis(100 * done));
            from = to;
        }
        watch
    }

    #[test]
    fn the_fourth_early_ping_trips_the_policy_however_the_bytes_are_cut() {
        let (bytes, pings) = client_bytes();
        let whole = feed(&bytes, &[], &pings);
        assert!(whole.too_many_pings());
        assert_eq!(whole.last_stream, 1);
        assert_eq!(whole.table_size, Some(512), "the client's HEADER_TABLE_SIZE");
        assert_eq!(whole.streams, [OpenStream { id: 1, answered: false }]);
        assert!(whole.farewell_due());
        let expected = whole.farewell();
        for cut in 1..bytes.len() {
            let watch = feed(&bytes, &[cut], &pings);
            assert!(watch.too_many_pings(), "cut at {cut}");
            assert_eq!(watch.farewell(), expected, "cut at {cut}");
        }
        let every_byte: Vec<usize> = (1..bytes.len()).collect();
        assert_eq!(feed(&bytes, &every_byte, &pings).farewell(), expected);
    }

    #[test]
    fn acks_settings_and_window_updates_are_no_pings_and_forgive_nothing() {
        let mut watch = Watch::new(policy());
        server_start(&mut watch);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(HEADERS, END_HEADERS, 1, &[0x83]));
        watch.read(&bytes, Instant::now());
        let start = Instant::now();
        for i in 0..100 {
            watch.read(&ping(true), start + Duration::from_millis(i));
        }
        assert_eq!(watch.strikes.count, 0, "acks are not pings");
        let mut at = start;
        for _ in 0..3 {
            at += Duration::from_millis(100);
            watch.read(&ping(false), at);
            watch.read(&frame(SETTINGS, 0, 0, &[]), at);
            watch.read(&frame(WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]), at);
            watch.read(&frame(DATA, 0, 1, &[0; 100]), at);
            watch.wrote(&frame(SETTINGS, ACK, 0, &[]));
            watch.wrote(&ping(true));
            watch.wrote(&frame(WINDOW_UPDATE, 0, 1, &[0, 0, 1, 0])); // a stream's: not gRPC core's reset
        }
        assert!(!watch.too_many_pings(), "two strikes");
        watch.read(&ping(false), at + Duration::from_millis(100));
        assert!(watch.too_many_pings(), "the client's frames forgave nothing");
    }

    #[test]
    fn without_a_call_open_pings_an_hour_apart_are_strikes() {
        let mut watch = Watch::new(policy());
        server_start(&mut watch);
        let start = Instant::now();
        watch.read(PREFACE, start);
        let hourly = |watch: &mut Watch, from: u32| {
            (from..from + 4).map(|h| watch.read(&ping(false), start + 3600 * SECOND * h).is_some()).collect::<Vec<_>>()
        };
        // A call opened and answered to its end: the connection is idle again.
        watch.read(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &[0x83]), start);
        assert!(!watch.streams.is_empty());
        watch.read(&ping(false), start);
        watch.read(&ping(false), start + Duration::from_secs(10));
        assert_eq!(watch.strikes.count, 0, "10 s apart with a call open");
        watch.wrote(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &[0x88]));
        assert_eq!(hourly(&mut watch, 1), [false, false, false, true]);
    }

    #[test]
    fn what_the_server_sends_forgives_the_strikes() {
        for forgiving in [
            frame(HEADERS, END_HEADERS, 1, &[0x88]),
            frame(DATA, 0, 1, &[0; 5]),
            frame(WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]),
        ] {
            let mut watch = Watch::new(policy());
            server_start(&mut watch);
            let mut bytes = PREFACE.to_vec();
            bytes.extend(frame(HEADERS, END_HEADERS, 1, &[0x83]));
            watch.read(&bytes, Instant::now());
            let start = Instant::now();
            for i in 1..=30 {
                watch.read(&ping(false), start + Duration::from_millis(100 * i));
                if i % 3 == 0 {
                    watch.wrote(&forgiving);
                }
            }
            assert!(!watch.too_many_pings(), "{forgiving:?}");
        }
    }

    #[test]
    fn the_farewell_waits_for_a_frame_boundary_outside_a_header_block() {
        let mut watch = Watch::new(policy());
        assert!(!watch.farewell_due());
        watch.too_many = true;
        assert!(!watch.farewell_due(), "not before the server's SETTINGS");
        server_start(&mut watch);
        assert!(watch.farewell_due());
        let data = frame(DATA, 0, 1, &[1; 20_000]);
        watch.wrote(&data[..5]);
        assert_eq!(watch.outbound_step(), 4, "the rest of the header");
        watch.wrote(&data[5..100]);
        assert!(!watch.farewell_due());
        assert_eq!(watch.outbound_step(), data.len() - 100, "the rest of the payload");
        watch.wrote(&data[100..]);
        assert!(watch.farewell_due());
        // A header block cut in two: HEADERS without END_HEADERS, then CONTINUATION.
        watch.wrote(&frame(HEADERS, 0, 1, &[0x88]));
        assert!(!watch.farewell_due(), "inside a header block");
        assert_eq!(watch.outbound_step(), HEADER_LEN, "the next frame may pass");
        watch.wrote(&frame(0x9, END_HEADERS, 1, &[0x5f]));
        assert!(watch.farewell_due());
    }

    #[test]
    fn the_farewell_is_goaway_then_each_open_calls_trailers_and_reset() {
        let mut watch = Watch::new(policy());
        server_start(&mut watch);
        let mut bytes = PREFACE.to_vec();
        for id in [1, 3, 5, 7] {
            bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, id, &[0x83]));
        }
        bytes.extend(frame(RST_STREAM, 0, 7, &[0, 0, 0, 8])); // the client cancelled 7
        watch.read(&bytes, Instant::now());
        watch.wrote(&frame(HEADERS, END_HEADERS, 3, &[0x88])); // 3 answered, still open
        watch.wrote(&frame(HEADERS, END_HEADERS | END_STREAM, 5, &[0x88])); // 5 ended
        let farewell = watch.farewell();
        let mut expected = frame(GOAWAY, 0, 0, &[&7u32.to_be_bytes()[..], &[0, 0, 0, 0xb], b"too_many_pings"].concat());
        let mut block = vec![0x88, 0x00, 12];
        block.extend(b"content-type");
        block.push(16);
        block.extend(b"application/grpc");
        let trailers =
            [&[0x00, 11][..], b"grpc-status", &[2], b"14", &[0x00, 12], b"grpc-message", &[14], b"Too many pings"]
                .concat();
        block.extend(&trailers);
        expected.extend(frame(HEADERS, END_STREAM | END_HEADERS, 1, &block));
        expected.extend(frame(RST_STREAM, 0, 1, &[0, 0, 0, 0]));
        expected.extend(frame(HEADERS, END_STREAM | END_HEADERS, 3, &trailers));
        expected.extend(frame(RST_STREAM, 0, 3, &[0, 0, 0, 0]));
        assert_eq!(farewell, expected);
    }

    #[test]
    fn a_smaller_hpack_table_is_announced_at_the_farewells_first_block() {
        let mut block = Vec::new();
        hpack_int(&mut block, 5, 0x20, 512);
        assert_eq!(block, [0x3f, 0xe1, 0x03], "RFC 7541 §5.1: 31 + 225 + 2 × 128");
        let mut watch = Watch::new(policy());
        server_start(&mut watch);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(SETTINGS, 0, 0, &[0, 1, 0, 0, 0, 0]));
        bytes.extend(frame(HEADERS, END_HEADERS, 1, &[0x83]));
        watch.read(&bytes, Instant::now());
        let farewell = watch.farewell();
        let goaway = HEADER_LEN + 8 + 14;
        assert_eq!(&farewell[goaway + HEADER_LEN..goaway + HEADER_LEN + 2], [0x20, 0x88], "size 0, then :status");
    }

    /// hyper's HTTP/2 server behind the watcher, a client of raw frames with a call open that pings
    /// eight times, all in one write or 20 ms apart: it reads GOAWAY, the call's trailers and reset,
    /// then the end of the stream, and hyper's connection ends once the client has gone.
    #[tokio::test]
    async fn hyper_behind_the_watcher_sends_the_farewell_and_ends() {
        for apart in [false, true] {
            pinged_too_often(apart).await;
        }
    }

    async fn pinged_too_often(apart: bool) {
        use hyper::server::conn::http2;
        use hyper_util::rt::{TokioExecutor, TokioIo};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let (server, mut client) = tokio::io::duplex(1 << 16);
        let service = hyper::service::service_fn(|_request| async {
            std::future::pending::<Result<hyper::Response<http_body_util::Empty<bytes::Bytes>>, std::io::Error>>().await
        });
        let connection = tokio::spawn(
            http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(Policed::new(server, policy())), service),
        );
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(SETTINGS, 0, 0, &[]));
        bytes.extend(frame(HEADERS, END_HEADERS, 1, &[0x83, 0x86, 0x84])); // POST http /
                                                                           // Eight: h2's first connection WINDOW_UPDATE may come after the first ping and forgive it.
        for _ in 0..8 {
            bytes.extend(ping(false));
            if apart {
                client.write_all(&bytes).await.ok();
                bytes.clear();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        client.write_all(&bytes).await.ok();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer)).await;
        assert!(matches!(read, Ok(Ok(_))), "the server closed its side: {read:?}");
        let mut frames = Vec::new();
        let mut rest = &answer[..];
        while rest.len() >= HEADER_LEN {
            let len = (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
            let end = (HEADER_LEN + len).min(rest.len());
            frames.push((
                rest[3],
                rest[4],
                u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]),
                &rest[HEADER_LEN..end],
            ));
            rest = &rest[end..];
        }
        let acks = frames.iter().filter(|f| f.0 == PING).count();
        assert!(acks <= 4, "the ping that was one too many is not acknowledged, nor any after: {acks}");
        if apart {
            assert!(acks >= 3, "each ping before it was: {acks}");
        }
        let at = frames.iter().position(|f| f.0 == GOAWAY).unwrap_or(usize::MAX);
        let farewell: Vec<(u8, u8, u32)> = frames.iter().skip(at).map(|f| (f.0, f.1, f.2)).collect();
        assert_eq!(farewell, [(GOAWAY, 0, 0), (HEADERS, END_STREAM | END_HEADERS, 1), (RST_STREAM, 0, 1)]);
        assert_eq!(frames[at].3, [&[0, 0, 0, 1, 0, 0, 0, 0xb][..], b"too_many_pings"].concat());
        drop(client);
        let ended = tokio::time::timeout(LINGER + Duration::from_secs(2), connection).await;
        assert!(ended.is_ok(), "hyper's connection ended");
    }

    /// What the watcher costs per read and per write (`cargo test --release -- --ignored
    /// per_read_cost --nocapture`): a 16 KiB read of 16 KiB DATA frames (a big message), and a
    /// 120-byte read holding a unary call's HEADERS and DATA (a small one).
    #[test]
    #[ignore]
    fn per_read_cost() {
        let mut big = Vec::new();
        for _ in 0..64 {
            big.extend(frame(DATA, 0, 1, &[0; 16_375]));
        }
        let mut small = frame(HEADERS, END_HEADERS, 3, &[0x83; 60]);
        small.extend(frame(DATA, END_STREAM, 3, &[0; 42]));
        for (name, bytes, piece) in [("16 KiB reads of DATA", &big, 16_384), ("unary call reads", &small, small.len())]
        {
            let mut watch = Watch::new(policy());
            server_start(&mut watch);
            watch.read(PREFACE, Instant::now());
            let rounds = 200_000;
            let started = Instant::now();
            for _ in 0..rounds / (bytes.len() / piece) {
                for chunk in bytes.chunks(piece) {
                    watch.read(std::hint::black_box(chunk), Instant::now());
                    watch.wrote(std::hint::black_box(chunk));
                }
            }
            let each = started.elapsed() / rounds as u32;
            println!("{name}: {each:?} per read and write of {piece} bytes");
        }
    }

    #[test]
    fn garbage_never_panics() {
        let mut watch = Watch::new(policy());
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let len = (seed % 300) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            watch.read(&bytes, Instant::now());
            watch.wrote(&bytes);
            let _ = watch.farewell();
        }
    }
}
