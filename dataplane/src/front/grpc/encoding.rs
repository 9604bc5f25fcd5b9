//! Messages a client sends compressed (the message's compressed flag, by its call's
//! `grpc-encoding`): gzip and deflate, what grpc clients send, are inflated here before the front
//! inspects them, by the HTTP front's rule (protocol/inflate.rs: never more than the message bound
//! inflated, so a decompression bomb stops there); any other encoding is refused UNIMPLEMENTED, as
//! gRPC's own servers refuse one they do not know. Triton, and the Python gRPC server a call is
//! handed to, get the message uncompressed; answers are sent uncompressed (legal whatever the
//! client's grpc-accept-encoding), with `grpc-accept-encoding` saying what the front inflates.

use bytes::Bytes;
use hyper::header::HeaderMap;

use crate::front::lane;
use crate::protocol::inflate::{inflate, Unpacked};
use crate::protocol::pytext::cut;

use super::wire::{self, Code};

/// `grpc-accept-encoding` on the front's answers: the encodings it reads.
pub const ACCEPTED: &str = "identity, deflate, gzip";

/// A call's `grpc-encoding`: how its messages flagged compressed are compressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Encoding {
    /// Absent or `identity`: no message may be flagged compressed.
    Identity,
    Gzip,
    Deflate,
    /// Any other (snappy, zstd, ...), as the client wrote it.
    Other(String),
}

impl Encoding {
    pub fn of(headers: &HeaderMap) -> Encoding {
        let Some(value) = headers.get("grpc-encoding") else { return Encoding::Identity };
        let value = String::from_utf8_lossy(value.as_bytes()).trim().to_ascii_lowercase();
        match value.as_str() {
            "" | "identity" => Encoding::Identity,
            "gzip" => Encoding::Gzip,
            "deflate" => Encoding::Deflate,
            _ => Encoding::Other(value),
        }
    }

    fn name(&self) -> &str {
        match self {
            Encoding::Identity => "identity",
            Encoding::Gzip => "gzip",
            Encoding::Deflate => "deflate",
            Encoding::Other(name) => name,
        }
    }
}

/// Why a compressed message is not served: the call's status, the refusal's reason label and words.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub code: Code,
    pub reason: &'static str,
    pub message: String,
}

/// A message flagged compressed, inflated by its call's encoding: at most `limit` bytes (the bound
/// its uncompressed form has: RESOURCE_EXHAUSTED in grpcio's words past it), UNIMPLEMENTED for an
/// encoding the front does not read, INVALID_ARGUMENT for bytes that are not of their encoding.
/// Inflated where the HTTP lane inflates (`lane::inflated_off_worker`: a large one off the workers).
pub async fn inflated(encoding: &Encoding, packed: Bytes, limit: usize) -> Result<Bytes, Refused> {
    let gzip = match encoding {
        Encoding::Gzip => true,
        Encoding::Deflate => false,
        Encoding::Identity | Encoding::Other(_) => return Err(unimplemented(encoding)),
    };
    match lane::inflated_off_worker(packed, move |packed| inflate(packed, gzip, limit)).await {
        Ok(message) => Ok(Bytes::from(message)),
        // grpcio's own words for a message over grpc.max_receive_message_length; the inflated
        // size is not known (inflating stopped at the bound).
        Err(Unpacked::TooLarge) => Err(Refused {
            code: wire::RESOURCE_EXHAUSTED,
            reason: "body_too_large",
            message: format!(
                "Received message larger than max (over {limit} bytes once inflated from {} vs. {limit})",
                encoding.name()
            ),
        }),
        Err(Unpacked::Unreadable(e)) => Err(Refused {
            code: wire::INVALID_ARGUMENT,
            reason: "malformed",
            message: format!("the message cannot be inflated ({}): {e}", encoding.name()),
        }),
    }
}

/// A compressed message whose encoding the front does not read (or that names none).
fn unimplemented(encoding: &Encoding) -> Refused {
    let said = match encoding {
        Encoding::Identity => "a message flagged compressed with grpc-encoding identity (or none)".to_owned(),
        _ => format!("a message compressed with grpc-encoding '{}'", cut(encoding.name(), 60)),
    };
    let message = format!(
        "{said}: the sidecar accepts grpc-encoding identity, deflate or gzip (grpc-accept-encoding: {ACCEPTED}); \
         send the message uncompressed, gzip or deflate"
    );
    Refused { code: wire::UNIMPLEMENTED, reason: "unsupported_media_type", message }
}

/// A unary call's body with its one message uncompressed (framed again, flag clear); a body that is
/// not one whole message, or one already uncompressed, as it came.
pub async fn unpack_unary(body: Bytes, encoding: &Encoding, limit: usize) -> Result<Bytes, Refused> {
    if body.len() < 5 || body[0] == 0 {
        return Ok(body);
    }
    let length = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if body.len() != 5 + length {
        return Ok(body);
    }
    inflated(encoding, body.slice(5..), limit).await.map(|message| wire::frame(&message))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use flate2::write::{GzEncoder, ZlibEncoder};
    use flate2::Compression;
    use hyper::header::HeaderValue;

    use super::*;

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

    fn compressed(packed: &[u8]) -> Bytes {
        let mut framed = wire::frame(packed).to_vec();
        framed[0] = 1;
        Bytes::from(framed)
    }

    #[test]
    fn the_encoding_is_read_from_grpc_encoding_whatever_its_case() {
        let mut headers = HeaderMap::new();
        assert_eq!(Encoding::of(&headers), Encoding::Identity);
        for (value, want) in [
            ("gzip", Encoding::Gzip),
            (" Deflate", Encoding::Deflate),
            ("identity", Encoding::Identity),
            ("snappy", Encoding::Other("snappy".into())),
        ] {
            headers.insert("grpc-encoding", HeaderValue::from_static(value));
            assert_eq!(Encoding::of(&headers), want, "{value}");
        }
    }

    #[tokio::test]
    async fn gzip_and_deflate_messages_are_framed_again_uncompressed() {
        let message = b"a ModelInferRequest's bytes".repeat(50);
        let want = wire::frame(&message);
        let unpacked = unpack_unary(compressed(&gzip(&message)), &Encoding::Gzip, 4096).await;
        assert_eq!(unpacked, Ok(want.clone()));
        let unpacked = unpack_unary(compressed(&zlib(&message)), &Encoding::Deflate, 4096).await;
        assert_eq!(unpacked, Ok(want.clone()));
        // Uncompressed messages pass whatever the call's encoding (compression is per message).
        let unpacked = unpack_unary(want.clone(), &Encoding::Other("snappy".into()), 4096).await;
        assert_eq!(unpacked, Ok(want.clone()));
        // Not one whole message: left as it came (the caller refuses or hands it on as before).
        let cut_short = compressed(&gzip(&message)).slice(..10);
        assert_eq!(unpack_unary(cut_short.clone(), &Encoding::Gzip, 4096).await, Ok(cut_short));
        // Past the inline bound the message inflates on the blocking pool, to the same bytes.
        let large: Vec<u8> = (0..200_000u32).flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()).collect();
        let packed = gzip(&large);
        assert!(packed.len() > 16 * 1024);
        assert_eq!(inflated(&Encoding::Gzip, Bytes::from(packed), 1 << 20).await, Ok(Bytes::from(large)));
    }

    #[tokio::test]
    async fn a_bomb_stops_at_the_bound_and_other_encodings_are_unimplemented() {
        let bomb = Bytes::from(gzip(&vec![0u8; 16 << 20]));
        assert!(bomb.len() < 64 * 1024);
        let refused = inflated(&Encoding::Gzip, bomb, 1 << 20).await.unwrap_err();
        assert_eq!((refused.code, refused.reason), (wire::RESOURCE_EXHAUSTED, "body_too_large"));
        assert!(refused.message.starts_with("Received message larger than max ("), "{}", refused.message);
        let refused = inflated(&Encoding::Other("snappy".into()), Bytes::from_static(b"x"), 100).await.unwrap_err();
        assert_eq!(refused.code, wire::UNIMPLEMENTED);
        assert!(refused.message.contains("'snappy'") && refused.message.contains(ACCEPTED), "{}", refused.message);
        let refused = unpack_unary(compressed(&gzip(b"m")), &Encoding::Identity, 100).await.unwrap_err();
        assert_eq!(refused.code, wire::UNIMPLEMENTED);
        let refused = inflated(&Encoding::Deflate, Bytes::from_static(b"not zlib"), 100).await.unwrap_err();
        assert_eq!((refused.code, refused.reason), (wire::INVALID_ARGUMENT, "malformed"));
        assert!(
            refused.message.starts_with("the message cannot be inflated (deflate): Error -3"),
            "{}",
            refused.message
        );
    }
}
