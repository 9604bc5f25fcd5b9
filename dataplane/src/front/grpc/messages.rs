//! The messages of Triton's `grpc_service.proto` the gRPC front reads (ModelInfer's, and the documents
//! of `unary`), written by hand with prost's derive (no protoc on the machine, no build script). Tags
//! and types are the .proto's.
//!
//! A request is decoded only to be checked: the client's bytes go to Triton unchanged. A response is
//! decoded to be screened and re-encoded only when an output is removed, so `ModelInferResponse`
//! declares every field the .proto gives it (prost drops fields it does not know when encoding).

use std::collections::HashMap;

use bytes::Bytes;

#[derive(Clone, PartialEq, prost::Message)]
pub struct InferParameter {
    #[prost(oneof = "ParameterChoice", tags = "1, 2, 3, 4, 5")]
    pub parameter_choice: Option<ParameterChoice>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum ParameterChoice {
    #[prost(bool, tag = "1")]
    BoolParam(bool),
    #[prost(int64, tag = "2")]
    Int64Param(i64),
    #[prost(string, tag = "3")]
    StringParam(String),
    #[prost(double, tag = "4")]
    DoubleParam(f64),
    #[prost(uint64, tag = "5")]
    Uint64Param(u64),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InferTensorContents {
    #[prost(bool, repeated, tag = "1")]
    pub bool_contents: Vec<bool>,
    #[prost(int32, repeated, tag = "2")]
    pub int_contents: Vec<i32>,
    #[prost(int64, repeated, tag = "3")]
    pub int64_contents: Vec<i64>,
    #[prost(uint32, repeated, tag = "4")]
    pub uint_contents: Vec<u32>,
    #[prost(uint64, repeated, tag = "5")]
    pub uint64_contents: Vec<u64>,
    #[prost(float, repeated, tag = "6")]
    pub fp32_contents: Vec<f32>,
    #[prost(double, repeated, tag = "7")]
    pub fp64_contents: Vec<f64>,
    #[prost(bytes = "bytes", repeated, tag = "8")]
    pub bytes_contents: Vec<Bytes>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InferInputTensor {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub datatype: String,
    #[prost(int64, repeated, tag = "3")]
    pub shape: Vec<i64>,
    #[prost(map = "string, message", tag = "4")]
    pub parameters: HashMap<String, InferParameter>,
    #[prost(message, optional, tag = "5")]
    pub contents: Option<InferTensorContents>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InferRequestedOutputTensor {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(map = "string, message", tag = "2")]
    pub parameters: HashMap<String, InferParameter>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelInferRequest {
    #[prost(string, tag = "1")]
    pub model_name: String,
    #[prost(string, tag = "2")]
    pub model_version: String,
    #[prost(string, tag = "3")]
    pub id: String,
    #[prost(map = "string, message", tag = "4")]
    pub parameters: HashMap<String, InferParameter>,
    #[prost(message, repeated, tag = "5")]
    pub inputs: Vec<InferInputTensor>,
    #[prost(message, repeated, tag = "6")]
    pub outputs: Vec<InferRequestedOutputTensor>,
    #[prost(bytes = "bytes", repeated, tag = "7")]
    pub raw_input_contents: Vec<Bytes>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InferOutputTensor {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub datatype: String,
    #[prost(int64, repeated, tag = "3")]
    pub shape: Vec<i64>,
    #[prost(map = "string, message", tag = "4")]
    pub parameters: HashMap<String, InferParameter>,
    #[prost(message, optional, tag = "5")]
    pub contents: Option<InferTensorContents>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelInferResponse {
    #[prost(string, tag = "1")]
    pub model_name: String,
    #[prost(string, tag = "2")]
    pub model_version: String,
    #[prost(string, tag = "3")]
    pub id: String,
    #[prost(map = "string, message", tag = "4")]
    pub parameters: HashMap<String, InferParameter>,
    #[prost(message, repeated, tag = "5")]
    pub outputs: Vec<InferOutputTensor>,
    #[prost(bytes = "bytes", repeated, tag = "6")]
    pub raw_output_contents: Vec<Bytes>,
}

/// ModelReadyRequest, ModelMetadataRequest, ModelConfigRequest and ModelStatisticsRequest: the same
/// two fields (the model's name and version) under the same tags.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

/// ServerLiveResponse (`live`), ServerReadyResponse and ModelReadyResponse (`ready`): one bool, tag 1.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Verdict {
    #[prost(bool, tag = "1")]
    pub yes: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ServerMetadataResponse {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
    #[prost(string, repeated, tag = "3")]
    pub extensions: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorMetadata {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub datatype: String,
    #[prost(int64, repeated, tag = "3")]
    pub shape: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelMetadataResponse {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, repeated, tag = "2")]
    pub versions: Vec<String>,
    #[prost(string, tag = "3")]
    pub platform: String,
    #[prost(message, repeated, tag = "4")]
    pub inputs: Vec<TensorMetadata>,
    #[prost(message, repeated, tag = "5")]
    pub outputs: Vec<TensorMetadata>,
}

/// One message of ModelStreamInfer's answer: Triton's response to a request on the stream, or its
/// in-stream error (the stream goes on after it).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelStreamInferResponse {
    #[prost(string, tag = "1")]
    pub error_message: String,
    #[prost(message, optional, tag = "2")]
    pub infer_response: Option<ModelInferResponse>,
}

/// A parameter of a repository call (`ModelRepositoryParameter`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RepositoryParameter {
    #[prost(oneof = "RepositoryParameterChoice", tags = "1, 2, 3, 4")]
    pub parameter_choice: Option<RepositoryParameterChoice>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum RepositoryParameterChoice {
    #[prost(bool, tag = "1")]
    BoolParam(bool),
    #[prost(int64, tag = "2")]
    Int64Param(i64),
    #[prost(string, tag = "3")]
    StringParam(String),
    #[prost(bytes = "bytes", tag = "4")]
    BytesParam(Bytes),
}

/// `RepositoryModelLoadRequest` and `RepositoryModelUnloadRequest`: the .proto gives both the same
/// fields (their answers are empty messages).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RepositoryModelRequest {
    #[prost(string, tag = "1")]
    pub repository_name: String,
    #[prost(string, tag = "2")]
    pub model_name: String,
    #[prost(map = "string, message", tag = "3")]
    pub parameters: HashMap<String, RepositoryParameter>,
}
