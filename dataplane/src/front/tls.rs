//! TLS on the front's ports (`tls.*`, docs/tls.md), terminated with rustls: listen.port, and
//! listen.grpc_port with `listen.grpc_front: rust` (each its own `Terminator` and ALPN, built from
//! the same material and swapped together at a rotation).
//!
//! Python reads and checks the files (sidecar/fronts/tls.py: `load_material`) and hands the PEM bytes
//! down at start and at every rotation its watch sees; `Terminator::swap` puts the new
//! `ServerConfig` in force atomically, so every handshake after the swap is served the new
//! certificate while connections already open keep the session they were made with.
//!
//! Mutual TLS (`tls.client_ca_file`): a client certificate is required and verified against the CA
//! bundle; with `tls.client_allowed_sans` it must also carry one of those DNS or URI SANs, checked in
//! the handshake itself (`AllowedClients`), so a refused client never reaches HTTP. Every failed
//! handshake is counted under the bounded reason labels Python's front uses
//! (`triton_sidecar_tls_handshake_failures_total{reason}`, `reason_of`).

use std::collections::HashSet;
use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    AlertDescription, CertificateError, DigitallySignedStruct, DistinguishedName, Error, PeerIncompatible,
    RootCertStore, ServerConfig, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::events::{Event, Events};

/// The bounded `reason` label of tls_handshake_failures_total (sidecar/fronts/tls.py's
/// HANDSHAKE_REASONS, in the same order).
pub const HANDSHAKE_REASONS: [&str; 8] = [
    "not_tls",
    "protocol_version",
    "no_client_certificate",
    "client_certificate_rejected",
    "client_san_not_allowed",
    "timeout",
    "client_closed",
    "other",
];

/// One complete set of files as Python read and checked them.
pub struct TlsMaterial {
    /// PEM certificate chain, the served (leaf) certificate first.
    pub cert_chain_pem: Vec<u8>,
    /// PEM private key of the leaf (PKCS#8, PKCS#1 or SEC1).
    pub key_pem: Vec<u8>,
    /// PEM CA bundle: set, every client must present a certificate it signed.
    pub client_ca_pem: Option<Vec<u8>>,
    /// DNS or URI SANs a client certificate must carry one of; empty: any the CA signed.
    pub allowed_sans: Vec<String>,
    /// "1.2" or "1.3" (tls.min_version).
    pub min_version: String,
}

/// Why a set of files cannot become a `ServerConfig` (Python checked them with OpenSSL first, so
/// this is rare: a key type rustls does not support, say). The message names the configuration key.
#[derive(Debug)]
pub enum MaterialError {
    Certificates(String),
    Key(String),
    ClientCa(String),
    MinVersion(String),
    Refused(Error),
}

impl fmt::Display for MaterialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaterialError::Certificates(why) => write!(f, "tls.cert_file: {why}"),
            MaterialError::Key(why) => write!(f, "tls.key_file: {why}"),
            MaterialError::ClientCa(why) => write!(f, "tls.client_ca_file: {why}"),
            MaterialError::MinVersion(given) => write!(f, "tls.min_version: {given:?} is not 1.2 or 1.3"),
            MaterialError::Refused(e) => write!(f, "tls.cert_file with tls.key_file: rustls refused them: {e}"),
        }
    }
}

impl std::error::Error for MaterialError {}

/// ALPN on listen.port: HTTP/1.1 only (the HTTP front speaks no HTTP/2; gRPC has its own port).
pub const ALPN_HTTP1: &[&[u8]] = &[b"http/1.1"];
/// ALPN on listen.grpc_port (listen.grpc_front: rust): gRPC is HTTP/2 only.
pub const ALPN_H2: &[&[u8]] = &[b"h2"];

/// The `ServerConfig` a set of files makes for one port: ring's primitives, TLS 1.2 and 1.3 or 1.3
/// alone, `alpn` the protocols offered (`ALPN_HTTP1`, `ALPN_H2`; a client that offers ALPN without
/// one of them is refused, one that offers none is served). Both ports build theirs from the same
/// material. `events` hears of the clients refused for their SANs (logged by Python as
/// tls_client_refused).
pub fn server_config(
    material: &TlsMaterial,
    alpn: &[&[u8]],
    events: Arc<Events>,
) -> Result<ServerConfig, MaterialError> {
    // ring's provider, deprecated in rustls 0.23.48 for lacking post-quantum key exchange: aws-lc-rs
    // has it but builds its C with cmake and nasm, which a fresh Debian machine lacks (Makefile:
    // `make test` needs only Python and cargo). Classical X25519/P-256 key exchange, as OpenSSL 3.0's.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = match material.min_version.as_str() {
        "1.2" => &[&rustls::version::TLS13, &rustls::version::TLS12],
        "1.3" => &[&rustls::version::TLS13],
        other => return Err(MaterialError::MinVersion(other.to_owned())),
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&material.cert_chain_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| MaterialError::Certificates(format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(MaterialError::Certificates("no certificate in it".to_owned()));
    }
    let key = PrivateKeyDer::from_pem_slice(&material.key_pem)
        .map_err(|e| MaterialError::Key(format!("not a PEM private key: {e}")))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(MaterialError::Refused)?;
    let builder = match &material.client_ca_pem {
        None => builder.with_no_client_auth(),
        Some(pem) => {
            let mut roots = RootCertStore::empty();
            for certificate in CertificateDer::pem_slice_iter(pem) {
                let certificate =
                    certificate.map_err(|e| MaterialError::ClientCa(format!("not a PEM CA bundle: {e}")))?;
                roots.add(certificate).map_err(|e| MaterialError::ClientCa(format!("not a CA certificate: {e}")))?;
            }
            let verified = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| MaterialError::ClientCa(e.to_string()))?;
            let allowed: HashSet<String> = material.allowed_sans.iter().cloned().collect();
            let protocol = if alpn == ALPN_H2 { "grpc" } else { "http" };
            builder.with_client_cert_verifier(Arc::new(AllowedClients { verified, allowed, events, protocol }))
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(MaterialError::Refused)?;
    config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
    Ok(config)
}

/// The TLS side of the listener: the configuration in force (swapped at every rotation, read
/// without a lock by each handshake) and the bound on one handshake.
pub struct Terminator {
    config: ArcSwap<ServerConfig>,
    /// A client that opens a socket and sends nothing must not hold a connection forever
    /// (sidecar/fronts/tls.py's HANDSHAKE_TIMEOUT_S, handed down by Python).
    timeout: Duration,
}

/// A connection whose handshake completed, with the client certificate's subject ("" without one).
pub struct Accepted<S> {
    pub stream: TlsStream<S>,
    pub client_subject: Arc<str>,
}

impl Terminator {
    pub fn new(config: ServerConfig, timeout: Duration) -> Self {
        Terminator { config: ArcSwap::from_pointee(config), timeout }
    }

    /// New handshakes use `config` from now on; open connections keep theirs.
    pub fn swap(&self, config: ServerConfig) {
        self.config.store(Arc::new(config));
    }

    /// The bound on one handshake (tls.handshake_timeout_s), which every TLS port shares.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The handshake, within the timeout; Err is the reason label of the failure.
    pub async fn accept<S>(&self, stream: S) -> Result<Accepted<S>, &'static str>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let acceptor = TlsAcceptor::from(self.config.load_full());
        let stream = match tokio::time::timeout(self.timeout, acceptor.accept(stream)).await {
            Err(_) => return Err("timeout"),
            Ok(Err(e)) => return Err(reason_of(&e)),
            Ok(Ok(stream)) => stream,
        };
        let client_subject = match stream.get_ref().1.peer_certificates().and_then(|chain| chain.first()) {
            Some(leaf) => Arc::from(subject_of(leaf.as_ref()).as_str()),
            None => Arc::from(""),
        };
        Ok(Accepted { stream, client_subject })
    }
}

/// The reason label of a failed handshake, from the I/O error tokio-rustls gives (a rustls error
/// inside it, or the socket's own).
pub fn reason_of(error: &io::Error) -> &'static str {
    if let Some(tls) = error.get_ref().and_then(|inner| inner.downcast_ref::<Error>()) {
        return reason_of_tls(tls);
    }
    match error.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => "client_closed",
        io::ErrorKind::TimedOut => "timeout",
        _ => "other",
    }
}

/// The reason label of a rustls error (sidecar/fronts/tls.py's handshake_reason maps OpenSSL's).
pub fn reason_of_tls(error: &Error) -> &'static str {
    use rustls::InvalidMessage;
    match error {
        // Bytes that are no TLS record at all: a plaintext HTTP request ("GET /" is no content type).
        Error::InvalidMessage(
            InvalidMessage::InvalidContentType
            | InvalidMessage::UnknownProtocolVersion
            | InvalidMessage::MessageTooLarge,
        ) => "not_tls",
        Error::PeerIncompatible(
            PeerIncompatible::SupportedVersionsExtensionRequired
            | PeerIncompatible::Tls12NotOffered
            | PeerIncompatible::Tls12NotOfferedOrEnabled
            | PeerIncompatible::ServerDoesNotSupportTls12Or13,
        ) => "protocol_version",
        Error::AlertReceived(AlertDescription::ProtocolVersion) => "protocol_version",
        Error::NoCertificatesPresented => "no_client_certificate",
        Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure) => "client_san_not_allowed",
        Error::InvalidCertificate(_) | Error::AlertReceived(AlertDescription::UnknownCA) => {
            "client_certificate_rejected"
        }
        _ => "other",
    }
}

/// The CA's verification, then `tls.client_allowed_sans`: a verified certificate without one of
/// them is refused in the handshake (access_denied), before any HTTP is read.
struct AllowedClients {
    verified: Arc<dyn ClientCertVerifier>,
    allowed: HashSet<String>,
    events: Arc<Events>,
    /// The port's protocol, for the log line ("http", or "grpc" for the port that offers h2).
    protocol: &'static str,
}

impl fmt::Debug for AllowedClients {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllowedClients").field("allowed", &self.allowed).finish_non_exhaustive()
    }
}

impl ClientCertVerifier for AllowedClients {
    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.verified.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        let verified = self.verified.verify_client_cert(end_entity, intermediates, now)?;
        if self.allowed.is_empty() || san_allowed(&client_sans(end_entity.as_ref()), &self.allowed) {
            return Ok(verified);
        }
        self.events.push(Event::TlsRefused {
            reason: "client_san_not_allowed",
            client_subject: subject_of(end_entity.as_ref()),
            protocol: self.protocol,
        });
        Err(Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.verified.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.verified.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.verified.supported_verify_schemes()
    }
}

/// Whether one of a certificate's SANs is allowed: exact, as sidecar/fronts/tls.py compares them.
pub fn san_allowed(sans: &[String], allowed: &HashSet<String>) -> bool {
    sans.iter().any(|san| allowed.contains(san))
}

/// The DNS and URI SANs of a DER certificate (none when it does not parse: refused, then).
pub fn client_sans(der: &[u8]) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, certificate)) = x509_parser::parse_x509_certificate(der) else { return Vec::new() };
    let Ok(Some(extension)) = certificate.subject_alternative_name() else { return Vec::new() };
    extension
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(value) | GeneralName::URI(value) => Some((*value).to_owned()),
            _ => None,
        })
        .collect()
}

/// Attribute names as RFC 4514 writes them (sidecar/fronts/tls.py's _SHORT_NAMES); others by the
/// long name ssl gives them, or their dotted OID.
const SHORT_NAMES: [(&str, &str); 10] = [
    ("2.5.4.3", "CN"),
    ("2.5.4.10", "O"),
    ("2.5.4.11", "OU"),
    ("2.5.4.6", "C"),
    ("2.5.4.8", "ST"),
    ("2.5.4.7", "L"),
    ("0.9.2342.19200300.100.1.25", "DC"),
    ("0.9.2342.19200300.100.1.1", "UID"),
    ("2.5.4.5", "serialNumber"),
    ("1.2.840.113549.1.9.1", "emailAddress"),
];

/// The RFC 4514 subject of a DER certificate ("CN=client,O=bank"), as the access log's
/// client_subject reads on the Python front; "" when it does not parse.
pub fn subject_of(der: &[u8]) -> String {
    let Ok((_, certificate)) = x509_parser::parse_x509_certificate(der) else { return String::new() };
    let rdns: Vec<_> = certificate.subject().iter_rdn().collect();
    let mut parts = Vec::new();
    for rdn in rdns.into_iter().rev() {
        for attribute in rdn.iter() {
            let oid = attribute.attr_type().to_id_string();
            let name = SHORT_NAMES.iter().find(|(o, _)| *o == oid).map_or(oid.clone(), |(_, n)| (*n).to_owned());
            let value = attribute.as_str().map(str::to_owned).unwrap_or_default();
            parts.push(format!("{name}={value}"));
        }
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client certificate made with sidecar.devtools.certificates.issue(ca, "fraud-scorer",
    /// uris=("spiffe://bank.example/ns/fraud/sa/scorer",), dns=("scorer.fraud",), client=True).
    const CLIENT_PEM: &str = include_str!("testdata/client.pem");

    fn client_der() -> Vec<u8> {
        CertificateDer::from_pem_slice(CLIENT_PEM.as_bytes()).map(|c| c.as_ref().to_vec()).unwrap_or_default()
    }

    #[test]
    fn a_certificates_dns_and_uri_sans_are_read_and_matched_exactly() {
        let sans = client_sans(&client_der());
        assert_eq!(sans, vec!["scorer.fraud".to_owned(), "spiffe://bank.example/ns/fraud/sa/scorer".to_owned()]);
        let allowed = |names: &[&str]| names.iter().map(|s| (*s).to_owned()).collect::<HashSet<_>>();
        assert!(san_allowed(&sans, &allowed(&["spiffe://bank.example/ns/fraud/sa/scorer"])));
        assert!(san_allowed(&sans, &allowed(&["other", "scorer.fraud"])));
        assert!(!san_allowed(&sans, &allowed(&["spiffe://bank.example/ns/batch/sa/job"])));
        assert!(!san_allowed(&sans, &allowed(&["SCORER.FRAUD", "spiffe://bank.example/ns/fraud/sa"])));
        assert!(!san_allowed(&[], &allowed(&["scorer.fraud"])));
        assert!(client_sans(b"not a certificate").is_empty());
    }

    #[test]
    fn the_subject_reads_as_rfc_4514_with_the_common_name_first() {
        assert_eq!(subject_of(&client_der()), "CN=fraud-scorer,O=triton-sidecar tests");
        assert_eq!(subject_of(b"garbage"), "");
    }

    /// A throwaway server certificate and its key (sidecar.devtools.certificates.server_cert), for
    /// handshakes in these tests only.
    fn material(min_version: &str) -> TlsMaterial {
        TlsMaterial {
            cert_chain_pem: include_bytes!("testdata/server.pem").to_vec(),
            key_pem: include_bytes!("testdata/server.key").to_vec(),
            client_ca_pem: None,
            allowed_sans: vec![],
            min_version: min_version.to_owned(),
        }
    }

    #[test]
    fn a_set_rustls_cannot_use_is_refused_naming_the_key() {
        let events = Arc::new(Events::default());
        assert!(server_config(&material("1.2"), ALPN_HTTP1, events.clone()).is_ok());
        let mut bad = material("1.3");
        bad.key_pem = b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".to_vec();
        let refused = server_config(&bad, ALPN_HTTP1, events.clone()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.starts_with("tls.cert_file with tls.key_file"), "{refused}");
        let refused = server_config(&material("1.1"), ALPN_H2, events).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.starts_with("tls.min_version"), "{refused}");
    }

    #[test]
    fn each_port_offers_its_own_alpn_from_the_same_material() {
        let events = Arc::new(Events::default());
        let alpn = |protocols| {
            server_config(&material("1.3"), protocols, events.clone()).map(|c| c.alpn_protocols).unwrap_or_default()
        };
        assert_eq!(alpn(ALPN_HTTP1), vec![b"http/1.1".to_vec()]);
        assert_eq!(alpn(ALPN_H2), vec![b"h2".to_vec()]);
    }

    #[tokio::test]
    async fn a_plaintext_client_and_a_silent_one_fail_the_handshake_with_their_reason() {
        use tokio::io::AsyncWriteExt;
        let config = server_config(&material("1.2"), ALPN_H2, Arc::new(Events::default())).map_err(|e| e.to_string());
        let terminator = Terminator::new(config.unwrap_or_else(|e| panic!("{e}")), Duration::from_millis(100));

        let (server, mut client) = tokio::io::duplex(4096);
        let _ = client.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert_eq!(terminator.accept(server).await.err(), Some("not_tls"));

        let (server, _silent) = tokio::io::duplex(4096);
        assert_eq!(terminator.accept(server).await.err(), Some("timeout"));

        let (server, client) = tokio::io::duplex(4096);
        drop(client);
        assert_eq!(terminator.accept(server).await.err(), Some("client_closed"));
    }

    #[test]
    fn handshake_failures_map_to_the_bounded_reasons_python_uses() {
        use rustls::InvalidMessage;
        let io_tls = |e: Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let cases: Vec<(io::Error, &str)> = vec![
            (io_tls(Error::InvalidMessage(InvalidMessage::InvalidContentType)), "not_tls"),
            (io_tls(Error::PeerIncompatible(PeerIncompatible::Tls12NotOfferedOrEnabled)), "protocol_version"),
            (io_tls(Error::PeerIncompatible(PeerIncompatible::SupportedVersionsExtensionRequired)), "protocol_version"),
            (io_tls(Error::AlertReceived(AlertDescription::ProtocolVersion)), "protocol_version"),
            (io_tls(Error::NoCertificatesPresented), "no_client_certificate"),
            (io_tls(Error::InvalidCertificate(CertificateError::UnknownIssuer)), "client_certificate_rejected"),
            (io_tls(Error::InvalidCertificate(CertificateError::Expired)), "client_certificate_rejected"),
            (
                io_tls(Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure)),
                "client_san_not_allowed",
            ),
            (io_tls(Error::PeerIncompatible(PeerIncompatible::NoCipherSuitesInCommon)), "other"),
            (io::Error::new(io::ErrorKind::UnexpectedEof, "tls handshake eof"), "client_closed"),
            (io::Error::from(io::ErrorKind::ConnectionReset), "client_closed"),
            (io::Error::other("something new"), "other"),
        ];
        for (error, reason) in cases {
            assert_eq!(reason_of(&error), reason, "{error:?}");
            assert!(HANDSHAKE_REASONS.contains(&reason));
        }
    }
}
