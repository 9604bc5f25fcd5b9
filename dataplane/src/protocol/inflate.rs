//! Request bodies sent compressed (`Content-Encoding: gzip`, `deflate` or `zstd`; `br` on the lane),
//! inflated before they are validated: by the HTTP front's lane, and by the Python listener through
//! the module (`sidecar._dataplane.inflate`), one rule for both.
//!
//! It is the Python listener's rule, as it was written on zlib's `decompressobj`: one stream (gzip
//! with its header, deflate with zlib's header), at most `limit` inflated bytes (a zip bomb stops
//! there, never inflated past it), a stream that ends early keeps what it inflated (zlib does not
//! call that an error; the body's validation then does), bytes after the stream's end ignored, and
//! a corrupt stream refused with zlib's own message (zlib-rs words them as zlib does).

use flate2::{Decompress, FlushDecompress, Status};

/// Why a compressed body cannot be served.
#[derive(Debug, PartialEq, Eq)]
pub enum Unpacked {
    /// It inflates past the limit: 413 body_too_large.
    TooLarge,
    /// Not a stream of its encoding: 400, with zlib's message as Python's zlib.error said it.
    Unreadable(String),
}

/// The inflated body, never more than `limit` bytes of it. `gzip`: a gzip stream, else a zlib
/// (deflate) one.
pub fn inflate(body: &[u8], gzip: bool, limit: usize) -> Result<Vec<u8>, Unpacked> {
    let mut inflater = if gzip { Decompress::new_gzip(15) } else { Decompress::new_with_window_bits(true, 15) };
    // One byte past the limit tells a body over it (zlib.decompressobj's max_length = limit + 1).
    let cap = limit.saturating_add(1);
    let mut out: Vec<u8> = Vec::with_capacity(cap.min(body.len().saturating_mul(4).max(4096)));
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let room = (cap - out.len()).min(chunk.len());
        if room == 0 {
            return Err(Unpacked::TooLarge);
        }
        let (read, wrote) = (inflater.total_in(), inflater.total_out());
        let consumed = read as usize;
        let status = inflater
            .decompress(&body[consumed.min(body.len())..], &mut chunk[..room], FlushDecompress::None)
            .map_err(|e| Unpacked::Unreadable(zlib_message(&e)))?;
        let produced = (inflater.total_out() - wrote) as usize;
        out.extend_from_slice(&chunk[..produced]);
        match status {
            Status::StreamEnd => break,
            // No progress: the input is all read (a stream cut short keeps what it gave).
            Status::Ok | Status::BufError if produced == 0 && inflater.total_in() == read => break,
            Status::Ok | Status::BufError => {}
        }
    }
    if out.len() > limit {
        return Err(Unpacked::TooLarge);
    }
    Ok(out)
}

/// The largest zstd window a body may ask for: its frames' history buffer is allocated up front, so
/// a frame of a few bytes declaring a 128 MiB window would make the decoder reserve that much. No
/// window need be larger than the body may be (validation.max_body_bytes), and 8 MiB covers what the
/// zstd tool's levels up to 19 write when they do not know the size beforehand.
fn zstd_window(limit: usize) -> u64 {
    (limit as u64).next_power_of_two().max(8 << 20)
}

/// A `Content-Encoding: zstd` body decoded (its frames one after another, RFC 8878), never more than
/// `limit` bytes of it; a frame asking for a larger window than zstd_window allows is unreadable.
pub fn unzstd(body: &[u8], limit: usize) -> Result<Vec<u8>, Unpacked> {
    use ruzstd::decoding::{FrameDecoder, StreamingDecoder};
    use std::io::Read;
    let cap = limit.saturating_add(1);
    let mut out: Vec<u8> = Vec::with_capacity(cap.min(body.len().saturating_mul(4).max(4096)));
    let mut source = body;
    while !source.is_empty() {
        let mut frames = FrameDecoder::new();
        frames.set_max_window_size(zstd_window(limit));
        let decoder = StreamingDecoder::new_with_decoder(&mut source, frames)
            .map_err(|e| Unpacked::Unreadable(format!("not a zstd frame: {e}")))?;
        let room = (cap - out.len()) as u64;
        decoder.take(room).read_to_end(&mut out).map_err(|e| Unpacked::Unreadable(format!("zstd: {e}")))?;
        if out.len() > limit {
            return Err(Unpacked::TooLarge);
        }
    }
    Ok(out)
}

/// What aiohttp said of a brotli body it could not decode (its RequestPayloadError, as
/// http_routes.unreadable_body quoted it).
pub const BROTLI_UNREADABLE: &str = "400, message:\n  Can not decode content-encoding: br";

/// A `Content-Encoding: br` body decoded, never more than `limit` bytes of it, as aiohttp behind the
/// front decoded it: a stream cut short keeps what it gave, anything else not brotli (bytes after
/// the stream's end too) is unreadable.
pub fn unbrotli(body: &[u8], limit: usize) -> Result<Vec<u8>, Unpacked> {
    use brotli_decompressor::{BrotliDecompressStream, BrotliResult, BrotliState, StandardAlloc};
    let mut state = BrotliState::new(StandardAlloc::default(), StandardAlloc::default(), StandardAlloc::default());
    let cap = limit.saturating_add(1);
    let mut out: Vec<u8> = Vec::with_capacity(cap.min(body.len().saturating_mul(4).max(4096)));
    let mut chunk = vec![0u8; 64 * 1024];
    let (mut available_in, mut input_offset, mut total_out) = (body.len(), 0usize, 0usize);
    loop {
        let room = (cap - out.len()).min(chunk.len());
        if room == 0 {
            return Err(Unpacked::TooLarge);
        }
        let (mut available_out, mut output_offset) = (room, 0usize);
        let result = BrotliDecompressStream(
            &mut available_in,
            &mut input_offset,
            body,
            &mut available_out,
            &mut output_offset,
            &mut chunk[..room],
            &mut total_out,
            &mut state,
        );
        out.extend_from_slice(&chunk[..output_offset]);
        match result {
            BrotliResult::ResultSuccess if available_in == 0 => break,
            BrotliResult::ResultSuccess | BrotliResult::ResultFailure => {
                return Err(Unpacked::Unreadable(BROTLI_UNREADABLE.to_owned()));
            }
            // All the input read and the stream not ended: cut short.
            BrotliResult::NeedsMoreInput => break,
            BrotliResult::NeedsMoreOutput => {}
        }
    }
    if out.len() > limit {
        return Err(Unpacked::TooLarge);
    }
    Ok(out)
}

/// zlib's error as CPython's zlib module words it (`Error <code> while decompressing data: <msg>`).
fn zlib_message(e: &flate2::DecompressError) -> String {
    if e.needs_dictionary().is_some() {
        return "Error 2 while decompressing data".to_owned();
    }
    format!("Error -3 while decompressing data: {}", e.message().unwrap_or("invalid input data"))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use flate2::write::{GzEncoder, ZlibEncoder};
    use flate2::Compression;

    use super::*;

    /// A zstd frame of `blocks` (RFC 8878 §3.1.1): no content size, a window of 2^(10 + exponent)
    /// bytes; each block raw (its bytes) or RLE (one byte repeated).
    fn zstd(exponent: u8, blocks: &[Block]) -> Vec<u8> {
        let mut frame = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, exponent << 3];
        for (i, block) in blocks.iter().enumerate() {
            let last = u32::from(i + 1 == blocks.len());
            let (kind, size, content) = match block {
                Block::Raw(bytes) => (0u32, bytes.len() as u32, bytes.clone()),
                Block::Rle(byte, times) => (1u32, *times, vec![*byte]),
            };
            frame.extend_from_slice(&(last | kind << 1 | size << 3).to_le_bytes()[..3]);
            frame.extend_from_slice(&content);
        }
        frame
    }

    enum Block {
        Raw(Vec<u8>),
        Rle(u8, u32),
    }

    #[test]
    fn a_zstd_body_is_decoded_within_the_limit_and_a_bomb_or_a_huge_window_is_not() {
        let body = br#"{"inputs": []}"#.to_vec();
        let frame = zstd(10, &[Block::Raw(body[..5].to_vec()), Block::Raw(body[5..].to_vec())]);
        assert_eq!(unzstd(&frame, 1024), Ok(body.clone()));
        // Two frames one after the other are one body.
        assert_eq!(unzstd(&[frame.clone(), frame].concat(), 1024), Ok([body.clone(), body].concat()));
        // 32 MiB of zeros in about a kilobyte: refused at the limit, never decoded past it.
        let bomb = zstd(10, &(0..256).map(|_| Block::Rle(0, 128 * 1024)).collect::<Vec<_>>());
        assert!(bomb.len() < 2048);
        assert_eq!(unzstd(&bomb, 1 << 20), Err(Unpacked::TooLarge));
        // A frame asking for a 1 GiB window (a few bytes that would make the decoder reserve it).
        assert!(matches!(unzstd(&zstd(20, &[Block::Rle(0, 1)]), 1 << 20), Err(Unpacked::Unreadable(_))));
        assert!(matches!(unzstd(b"\x28\xb5\x2f\xfd\xff\xff", 1024), Err(Unpacked::Unreadable(_))));
        assert!(matches!(unzstd(b"not zstd at all", 1024), Err(Unpacked::Unreadable(_))));
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut e = ZlibEncoder::new(Vec::new(), Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn gzip_and_deflate_inflate_within_the_limit() {
        let body = br#"{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}"#.repeat(100);
        assert_eq!(inflate(&gzip(&body), true, body.len()).unwrap(), body);
        assert_eq!(inflate(&zlib(&body), false, body.len()).unwrap(), body);
        assert_eq!(inflate(&gzip(&body), true, body.len() - 1), Err(Unpacked::TooLarge));
        // Bytes after the stream's end are ignored, as zlib's unused_data was.
        let mut trailing = gzip(b"{}");
        trailing.extend_from_slice(b"garbage");
        assert_eq!(inflate(&trailing, true, 100).unwrap(), b"{}");
    }

    #[test]
    fn brotli_decodes_within_the_limit_and_refuses_what_aiohttp_refused() {
        // "hello, brotli\n" as `brotli.compress` (quality 11) writes it.
        let packed: &[u8] = &[
            0x8b, 0x06, 0x80, 0x68, 0x65, 0x6c, 0x6c, 0x6f, 0x2c, 0x20, 0x62, 0x72, 0x6f, 0x74, 0x6c, 0x69, 0x0a, 0x03,
        ];
        assert_eq!(unbrotli(packed, 100).unwrap(), b"hello, brotli\n");
        assert_eq!(unbrotli(packed, 5), Err(Unpacked::TooLarge));
        let mut trailing = packed.to_vec();
        trailing.push(0);
        assert_eq!(unbrotli(&trailing, 100), Err(Unpacked::Unreadable(BROTLI_UNREADABLE.to_owned())));
        assert_eq!(unbrotli(&[0xff; 16], 100), Err(Unpacked::Unreadable(BROTLI_UNREADABLE.to_owned())));
        assert!(unbrotli(&packed[..packed.len() - 1], 100).is_ok());
    }

    #[test]
    fn a_zip_bomb_stops_at_the_limit() {
        let bomb = gzip(&vec![b' '; 64 * 1024 * 1024]);
        assert!(bomb.len() < 128 * 1024);
        assert_eq!(inflate(&bomb, true, 1024 * 1024), Err(Unpacked::TooLarge));
    }

    #[test]
    fn a_corrupt_stream_is_refused_with_zlib_s_message_and_a_cut_one_keeps_what_it_gave() {
        assert_eq!(
            inflate(b"{\"inputs\": []}", true, 100),
            Err(Unpacked::Unreadable("Error -3 while decompressing data: incorrect header check".to_owned()))
        );
        assert_eq!(
            inflate(b"{\"inputs\": []}", false, 100),
            Err(Unpacked::Unreadable("Error -3 while decompressing data: incorrect header check".to_owned()))
        );
        let whole = zlib(&b"0123456789".repeat(1000));
        let cut = inflate(&whole[..whole.len() / 2], false, 1 << 20).unwrap();
        assert!(!cut.is_empty() && cut.len() < 10_000);
        assert_eq!(inflate(b"", true, 100).unwrap(), b"");
    }
}
