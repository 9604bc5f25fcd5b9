//! The v2 and Triton vocabulary without I/O: JSON as Triton reads it, and the texts of messages as
//! the Python side has always written them (so a client sees the same words from either half).

pub mod answers;
pub mod datatypes;
pub mod inflate;
pub mod json;
pub mod pytext;
pub mod sse;
