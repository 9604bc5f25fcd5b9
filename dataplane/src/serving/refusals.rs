//! Why the sidecar answered a request itself. The label is the `reason` clients read and operators
//! count; the Python side's `sidecar.serving.refusals.Reason` maps each label to its HTTP status and
//! gRPC code, so a label here must be one of its values.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Malformed,
    Schema,
    UnknownInput,
    MissingInput,
    Datatype,
    Shape,
    NonFinite,
    OutOfRange,
    BytesTooLong,
    Parameter,
    UnknownOutput,
    FilteredOutput,
    SharedMemory,
    TooManyElements,
    UnknownField,
    TooManyTokens,
    /// The model's rule file (`validation.schemas`): its JSON Schema or its `x-tensors` rules.
    BusinessRule,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Malformed => "malformed",
            Reason::Schema => "schema",
            Reason::UnknownInput => "unknown_input",
            Reason::MissingInput => "missing_input",
            Reason::Datatype => "datatype",
            Reason::Shape => "shape",
            Reason::NonFinite => "non_finite",
            Reason::OutOfRange => "out_of_range",
            Reason::BytesTooLong => "bytes_element_too_long",
            Reason::Parameter => "parameter",
            Reason::UnknownOutput => "unknown_output",
            Reason::FilteredOutput => "filtered_output",
            Reason::SharedMemory => "shared_memory",
            Reason::TooManyElements => "too_many_elements",
            Reason::UnknownField => "unknown_field",
            Reason::TooManyTokens => "too_many_tokens",
            Reason::BusinessRule => "business_rule",
        }
    }
}

/// A request refused before Triton: the reason, a message a person can act on, and the input it
/// concerns ("" when none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub reason: Reason,
    pub message: String,
    pub input: String,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.reason.label(), self.message)
    }
}
