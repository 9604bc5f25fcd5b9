//! gRPC server reflection (`grpc.reflection.v1` and `grpc.reflection.v1alpha`, one wire format)
//! answered by the front: grpcurl, Postman and Gateway API GRPCRoute set-ups find the services and
//! their messages without a .proto file (Triton has no reflection; grpcio's server behind the front
//! never offered it).
//!
//! What it describes is vendored, not compiled here: `descriptors.binpb` is a FileDescriptorSet of
//! Triton's grpc_service.proto and model_config.proto (as tritonclient ships them), grpc.health.v1's
//! health.proto and the two reflection protos, made by `python -m sidecar.devtools.grpc_descriptors`
//! (descriptors.md says how, and tests/test_grpc.py checks it still matches the installed packages).
//! Each file's bytes are served as they are in the set; the index of names is read from them once.
//!
//! One bidirectional stream answers each request as it comes, in order. A name that is not there is
//! NOT_FOUND in an `error_response` and the stream goes on (the reflection spec); a request that is
//! not a ServerReflectionRequest ends the stream INTERNAL, as a server that cannot deserialize does.

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::LazyLock;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::header::HeaderValue;
use hyper::{Request, Response};
use prost::Message;

use super::wire::{self, Code, Deframed, Deframer, GrpcBody};
use super::GrpcFront;

pub const V1: &str = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
pub const V1ALPHA: &str = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

/// The vendored FileDescriptorSet (descriptors.md: how it was made).
const DESCRIPTORS: &[u8] = include_bytes!("descriptors.binpb");

// -- the reflection protocol's messages (grpc/reflection/v1/reflection.proto; v1alpha's are the same
// tags and types) --------------------------------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct ServerReflectionRequest {
    #[prost(string, tag = "1")]
    pub host: String,
    #[prost(oneof = "Question", tags = "3, 4, 5, 6, 7")]
    pub question: Option<Question>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Question {
    #[prost(string, tag = "3")]
    FileByFilename(String),
    #[prost(string, tag = "4")]
    FileContainingSymbol(String),
    #[prost(message, tag = "5")]
    FileContainingExtension(ExtensionRequest),
    #[prost(string, tag = "6")]
    AllExtensionNumbersOfType(String),
    #[prost(string, tag = "7")]
    ListServices(String),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExtensionRequest {
    #[prost(string, tag = "1")]
    pub containing_type: String,
    #[prost(int32, tag = "2")]
    pub extension_number: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ServerReflectionResponse {
    #[prost(string, tag = "1")]
    pub valid_host: String,
    #[prost(message, optional, tag = "2")]
    pub original_request: Option<ServerReflectionRequest>,
    #[prost(oneof = "Answer", tags = "4, 5, 6, 7")]
    pub answer: Option<Answer>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Answer {
    #[prost(message, tag = "4")]
    FileDescriptorResponse(FileDescriptorResponse),
    #[prost(message, tag = "5")]
    AllExtensionNumbersResponse(ExtensionNumberResponse),
    #[prost(message, tag = "6")]
    ListServicesResponse(ListServiceResponse),
    #[prost(message, tag = "7")]
    ErrorResponse(ErrorResponse),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct FileDescriptorResponse {
    #[prost(bytes = "bytes", repeated, tag = "1")]
    pub file_descriptor_proto: Vec<Bytes>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExtensionNumberResponse {
    #[prost(string, tag = "1")]
    pub base_type_name: String,
    #[prost(int32, repeated, tag = "2")]
    pub extension_number: Vec<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListServiceResponse {
    #[prost(message, repeated, tag = "1")]
    pub service: Vec<ServiceResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ServiceResponse {
    #[prost(string, tag = "1")]
    pub name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ErrorResponse {
    #[prost(int32, tag = "1")]
    pub error_code: i32,
    #[prost(string, tag = "2")]
    pub error_message: String,
}

// -- the part of google/protobuf/descriptor.proto the index reads (tags and types are its own) ---

#[derive(Clone, PartialEq, prost::Message)]
struct FileDescriptorSet {
    /// Each file's bytes as they are: what a client is sent.
    #[prost(bytes = "bytes", repeated, tag = "1")]
    file: Vec<Bytes>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct FileDescriptorProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    package: String,
    #[prost(string, repeated, tag = "3")]
    dependency: Vec<String>,
    #[prost(message, repeated, tag = "4")]
    message_type: Vec<DescriptorProto>,
    #[prost(message, repeated, tag = "5")]
    enum_type: Vec<EnumDescriptorProto>,
    #[prost(message, repeated, tag = "6")]
    service: Vec<ServiceDescriptorProto>,
    #[prost(message, repeated, tag = "7")]
    extension: Vec<FieldDescriptorProto>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct DescriptorProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, repeated, tag = "2")]
    field: Vec<FieldDescriptorProto>,
    #[prost(message, repeated, tag = "3")]
    nested_type: Vec<DescriptorProto>,
    #[prost(message, repeated, tag = "4")]
    enum_type: Vec<EnumDescriptorProto>,
    #[prost(message, repeated, tag = "6")]
    extension: Vec<FieldDescriptorProto>,
    #[prost(message, repeated, tag = "8")]
    oneof_decl: Vec<Named>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct FieldDescriptorProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    extendee: String,
    #[prost(int32, tag = "3")]
    number: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct EnumDescriptorProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, repeated, tag = "2")]
    value: Vec<Named>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ServiceDescriptorProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, repeated, tag = "2")]
    method: Vec<Named>,
}

/// Any descriptor of which only the name is read (a oneof, an enum value, a method).
#[derive(Clone, PartialEq, prost::Message)]
struct Named {
    #[prost(string, tag = "1")]
    name: String,
}

/// What reflection answers from: the files, and where each name is defined.
pub struct Index {
    /// (file name, its bytes, the files it imports, by index), in the set's order.
    files: Vec<(String, Bytes, Vec<usize>)>,
    by_name: HashMap<String, usize>,
    /// Every fully-qualified name a file defines (messages, fields, oneofs, enums and their values,
    /// services, methods, extensions), to its file.
    symbols: HashMap<String, usize>,
    /// Message types, each with the numbers of the extensions declared for it.
    messages: HashMap<String, Vec<i32>>,
    /// (extended type, number) of each extension, to its file.
    extensions: HashMap<(String, i32), usize>,
    services: Vec<String>,
}

/// The vendored set's index, read at the first reflection call; Err: why it could not be (a
/// vendored file that does not decode: a build of a broken tree, answered INTERNAL).
static INDEX: LazyLock<Result<Index, String>> = LazyLock::new(|| Index::read(DESCRIPTORS));

impl Index {
    pub fn read(set: &[u8]) -> Result<Index, String> {
        let set = FileDescriptorSet::decode(set).map_err(|e| format!("the vendored descriptor set: {e}"))?;
        let mut index = Index {
            files: Vec::new(),
            by_name: HashMap::new(),
            symbols: HashMap::new(),
            messages: HashMap::new(),
            extensions: HashMap::new(),
            services: Vec::new(),
        };
        let mut imports = Vec::new();
        for (i, bytes) in set.file.into_iter().enumerate() {
            let file = FileDescriptorProto::decode(bytes.clone())
                .map_err(|e| format!("the vendored descriptor set's file {i}: {e}"))?;
            let scope = file.package.clone();
            for message in &file.message_type {
                index.message(i, &scope, message);
            }
            for enumeration in &file.enum_type {
                index.enumeration(i, &scope, enumeration);
            }
            for extension in &file.extension {
                index.extension(i, &scope, extension);
            }
            for service in &file.service {
                let name = qualified(&scope, &service.name);
                for method in &service.method {
                    index.symbols.insert(qualified(&name, &method.name), i);
                }
                index.symbols.insert(name.clone(), i);
                index.services.push(name);
            }
            index.by_name.insert(file.name.clone(), i);
            index.files.push((file.name, bytes, Vec::new()));
            imports.push(file.dependency);
        }
        for (i, dependencies) in imports.into_iter().enumerate() {
            let mut found = Vec::with_capacity(dependencies.len());
            for dependency in dependencies {
                let at = index.by_name.get(&dependency).copied();
                found.push(at.ok_or_else(|| format!("the vendored descriptor set lacks {dependency}, an import"))?);
            }
            index.files[i].2 = found;
        }
        index.services.sort();
        Ok(index)
    }

    fn message(&mut self, file: usize, scope: &str, message: &DescriptorProto) {
        let name = qualified(scope, &message.name);
        for field in &message.field {
            self.symbols.insert(qualified(&name, &field.name), file);
        }
        for oneof in &message.oneof_decl {
            self.symbols.insert(qualified(&name, &oneof.name), file);
        }
        for nested in &message.nested_type {
            self.message(file, &name, nested);
        }
        for enumeration in &message.enum_type {
            self.enumeration(file, &name, enumeration);
        }
        for extension in &message.extension {
            self.extension(file, &name, extension);
        }
        self.symbols.insert(name.clone(), file);
        self.messages.entry(name).or_default();
    }

    fn enumeration(&mut self, file: usize, scope: &str, enumeration: &EnumDescriptorProto) {
        // protobuf's scoping: an enum's values are siblings of the enum, not inside it.
        for value in &enumeration.value {
            self.symbols.insert(qualified(scope, &value.name), file);
        }
        self.symbols.insert(qualified(scope, &enumeration.name), file);
    }

    fn extension(&mut self, file: usize, scope: &str, extension: &FieldDescriptorProto) {
        self.symbols.insert(qualified(scope, &extension.name), file);
        let extended = extension.extendee.trim_start_matches('.').to_owned();
        self.messages.entry(extended.clone()).or_default().push(extension.number);
        self.extensions.insert((extended, extension.number), file);
    }

    /// The services a client may call (every service the set defines).
    pub fn services(&self) -> &[String] {
        &self.services
    }

    /// `file`'s bytes first, then each file it imports, directly or not, that this stream has not
    /// sent yet (`sent`), so the client can build it without asking again.
    fn with_imports(&self, file: usize, sent: &mut HashSet<usize>) -> Vec<Bytes> {
        let mut out = vec![self.files[file].1.clone()];
        sent.insert(file);
        let mut queue: VecDeque<usize> = self.files[file].2.iter().copied().collect();
        while let Some(next) = queue.pop_front() {
            if sent.insert(next) {
                out.push(self.files[next].1.clone());
                queue.extend(self.files[next].2.iter().copied());
            }
        }
        out
    }

    /// The answer to one request (`sent`: the files this stream has sent so far).
    pub fn answer(&self, request: ServerReflectionRequest, sent: &mut HashSet<usize>) -> ServerReflectionResponse {
        let files = |file: usize, sent: &mut HashSet<usize>| {
            Answer::FileDescriptorResponse(FileDescriptorResponse {
                file_descriptor_proto: self.with_imports(file, sent),
            })
        };
        let answer = match &request.question {
            Some(Question::FileByFilename(name)) => match self.by_name.get(name) {
                Some(&file) => files(file, sent),
                None => not_found(format!("no file named {name:?}: {}", self.file_names())),
            },
            Some(Question::FileContainingSymbol(symbol)) => match self.symbols.get(symbol.trim_start_matches('.')) {
                Some(&file) => files(file, sent),
                None => not_found(format!("no symbol named {symbol:?}: the services are {}", self.services.join(", "))),
            },
            Some(Question::FileContainingExtension(asked)) => {
                let key = (asked.containing_type.trim_start_matches('.').to_owned(), asked.extension_number);
                match self.extensions.get(&key) {
                    Some(&file) => files(file, sent),
                    None => not_found(format!(
                        "no extension {} of {:?} is defined here",
                        asked.extension_number, asked.containing_type
                    )),
                }
            }
            Some(Question::AllExtensionNumbersOfType(name)) => match self.messages.get(name.trim_start_matches('.')) {
                Some(numbers) => {
                    let mut extension_number = numbers.clone();
                    extension_number.sort_unstable();
                    Answer::AllExtensionNumbersResponse(ExtensionNumberResponse {
                        base_type_name: name.trim_start_matches('.').to_owned(),
                        extension_number,
                    })
                }
                None => not_found(format!("no message type named {name:?}")),
            },
            Some(Question::ListServices(_)) => Answer::ListServicesResponse(ListServiceResponse {
                service: self.services.iter().map(|name| ServiceResponse { name: name.clone() }).collect(),
            }),
            None => Answer::ErrorResponse(ErrorResponse {
                error_code: i32::from(wire::INVALID_ARGUMENT.0),
                error_message: "the request asks nothing: set one of file_by_filename, file_containing_symbol, \
                                file_containing_extension, all_extension_numbers_of_type, list_services"
                    .to_owned(),
            }),
        };
        ServerReflectionResponse {
            valid_host: request.host.clone(),
            original_request: Some(request),
            answer: Some(answer),
        }
    }

    fn file_names(&self) -> String {
        let names: Vec<&str> = self.files.iter().map(|(name, _, _)| name.as_str()).collect();
        format!("the files are {}", names.join(", "))
    }
}

fn not_found(message: String) -> Answer {
    Answer::ErrorResponse(ErrorResponse { error_code: i32::from(wire::NOT_FOUND.0), error_message: message })
}

fn qualified(scope: &str, name: &str) -> String {
    if scope.is_empty() {
        name.to_owned()
    } else {
        format!("{scope}.{name}")
    }
}

/// One ServerReflectionInfo stream, answered here (counted in the front's `served`).
pub fn serve(front: &GrpcFront, request: Request<Incoming>) -> Response<GrpcBody> {
    front.served.fetch_add(1, Ordering::Relaxed);
    let index = match &*INDEX {
        Ok(index) => index,
        Err(e) => return wire::answer(wire::INTERNAL, e, false, None, &[]),
    };
    let body = Reflecting {
        index,
        incoming: request.into_body(),
        deframer: Deframer::default(),
        limit: front.shared.settings.max_body_bytes,
        out: VecDeque::new(),
        sent: HashSet::new(),
        ended: false,
    };
    let mut response = Response::new(body.boxed());
    response.headers_mut().insert("content-type", HeaderValue::from_static(wire::CONTENT_TYPE));
    response
}

/// The answer's body: it reads the client's requests as it is polled and sends each one's answer
/// (no task of its own: a client that leaves drops it, and nothing is left running).
struct Reflecting {
    index: &'static Index,
    incoming: Incoming,
    deframer: Deframer,
    /// validation.max_body_bytes: the bound on one message, as on every call of this port.
    limit: usize,
    out: VecDeque<Frame<Bytes>>,
    sent: HashSet<usize>,
    /// The trailers are queued: nothing more is read.
    ended: bool,
}

impl Reflecting {
    fn end(&mut self, code: Code, message: &str) {
        self.out.push_back(Frame::trailers(wire::trailers(code, message)));
        self.ended = true;
    }

    /// Answer every whole request received so far.
    fn answer_received(&mut self) {
        while !self.ended {
            match self.deframer.next(self.limit) {
                Deframed::Partial => return,
                Deframed::Message(message) => match ServerReflectionRequest::decode(message) {
                    Ok(request) => {
                        // This body is polled on the connection's task: a panic here would end every
                        // call on the connection, so it is caught and ends this stream alone.
                        let (index, sent) = (self.index, &mut self.sent);
                        let answered = std::panic::catch_unwind(AssertUnwindSafe(|| {
                            wire::frame(&index.answer(request, sent).encode_to_vec())
                        }));
                        match answered {
                            Ok(framed) => self.out.push_back(Frame::data(framed)),
                            Err(_) => self.end(
                                wire::INTERNAL,
                                "the sidecar failed while answering reflection; this is a bug in the sidecar",
                            ),
                        }
                    }
                    Err(e) => self.end(wire::INTERNAL, &format!("not a ServerReflectionRequest: {e}")),
                },
                Deframed::Compressed(_) => {
                    self.end(wire::UNIMPLEMENTED, "compressed messages are not accepted here: send them uncompressed")
                }
                Deframed::TooLarge(size) => {
                    let message = format!("Received message larger than max ({size} vs. {})", self.limit);
                    self.end(wire::RESOURCE_EXHAUSTED, &message);
                }
            }
        }
    }
}

impl Body for Reflecting {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some(frame) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(frame)));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.incoming).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        this.deframer.push(&data);
                        this.answer_received();
                    }
                }
                Poll::Ready(Some(Err(e))) => this.end(wire::CANCELLED, &format!("the client's stream broke off: {e}")),
                // The client is done asking: every answer is sent, the stream ends OK.
                Poll::Ready(None) if this.deframer.pending() == 0 => this.end(wire::OK, ""),
                Poll::Ready(None) => this.end(wire::INTERNAL, "the client's last message was cut short"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> &'static Index {
        match &*INDEX {
            Ok(index) => index,
            Err(e) => panic!("{e}"),
        }
    }

    fn ask(question: Question, sent: &mut HashSet<usize>) -> Answer {
        let request = ServerReflectionRequest { host: "h".to_owned(), question: Some(question) };
        let response = index().answer(request.clone(), sent);
        assert_eq!((response.valid_host.as_str(), response.original_request), ("h", Some(request)));
        response.answer.unwrap_or_else(|| panic!("no answer"))
    }

    fn file_names(answer: &Answer) -> Vec<String> {
        match answer {
            Answer::FileDescriptorResponse(files) => files
                .file_descriptor_proto
                .iter()
                .map(|b| FileDescriptorProto::decode(b.clone()).map(|f| f.name).unwrap_or_default())
                .collect(),
            other => panic!("not files: {other:?}"),
        }
    }

    #[test]
    fn the_vendored_set_lists_every_service_the_port_answers() {
        assert_eq!(
            index().services(),
            [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
                "inference.GRPCInferenceService",
            ]
        );
        let listed = ask(Question::ListServices(String::new()), &mut HashSet::new());
        assert!(matches!(listed, Answer::ListServicesResponse(l) if l.service.len() == 4));
    }

    #[test]
    fn a_symbol_s_file_comes_with_its_imports_once_a_stream() {
        let mut sent = HashSet::new();
        let service = ask(Question::FileContainingSymbol("inference.GRPCInferenceService".to_owned()), &mut sent);
        assert_eq!(file_names(&service), ["grpc_service.proto", "model_config.proto"]);
        // A method, a nested message and an enum value (a sibling of its enum) are symbols too.
        for symbol in [
            "inference.GRPCInferenceService.ModelInfer",
            ".inference.ModelInferRequest.InferInputTensor",
            "inference.ModelInferRequest.inputs",
        ] {
            let again = ask(Question::FileContainingSymbol(symbol.to_owned()), &mut sent);
            assert_eq!(file_names(&again), ["grpc_service.proto"], "{symbol}");
        }
        let config = ask(Question::FileByFilename("model_config.proto".to_owned()), &mut HashSet::new());
        assert_eq!(file_names(&config), ["model_config.proto"]);
        let health =
            ask(Question::FileContainingSymbol("grpc.health.v1.HealthCheckResponse.SERVING".to_owned()), &mut sent);
        assert_eq!(file_names(&health).len(), 1);
    }

    #[test]
    fn unknown_names_are_not_found_and_extensions_answered_as_the_spec_says() {
        let mut sent = HashSet::new();
        for question in [
            Question::FileByFilename("nope.proto".to_owned()),
            Question::FileContainingSymbol("inference.Nope".to_owned()),
            Question::FileContainingExtension(ExtensionRequest {
                containing_type: "inference.ModelInferRequest".to_owned(),
                extension_number: 100,
            }),
            Question::AllExtensionNumbersOfType("inference.Nope".to_owned()),
        ] {
            let answer = ask(question.clone(), &mut sent);
            assert!(matches!(answer, Answer::ErrorResponse(ErrorResponse { error_code: 5, .. })), "{question:?}");
        }
        let numbers = ask(Question::AllExtensionNumbersOfType("inference.ModelInferRequest".to_owned()), &mut sent);
        let want = ExtensionNumberResponse {
            base_type_name: "inference.ModelInferRequest".to_owned(),
            extension_number: vec![],
        };
        assert_eq!(numbers, Answer::AllExtensionNumbersResponse(want));
        let nothing = index().answer(ServerReflectionRequest::default(), &mut sent);
        assert!(matches!(nothing.answer, Some(Answer::ErrorResponse(ErrorResponse { error_code: 3, .. }))));
    }
}
