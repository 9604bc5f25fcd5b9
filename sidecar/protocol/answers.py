"""The tensors of a KServe v2 infer answer over HTTP (JSON, or JSON header + binary sections), as
numpy arrays: for the health loop's golden rounds (sidecar.health.infer_body), rollouts' compared
answers and the drift monitor (answer_tensors). The answer's bytes are never changed here.

The decoding itself is the data plane's (dataplane/src/protocol/answers.rs); this module only makes
arrays of what it hands back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sidecar import _dataplane

# numpy only where a function needs it (imported there): an idle sidecar never loads it (issue 30).
if TYPE_CHECKING:
    import numpy as np

#: Little-endian numpy dtypes of the fixed-size numeric datatypes (Triton's binary extension).
BINARY_DTYPES = {"UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "<i1", "INT16": "<i2",
                 "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


#: (name, datatype, shape, values): values a flat numpy array (of the datatype's dtype for an HTTP answer,
#: object for BYTES), or the raw bytes of a gRPC answer's raw_output_contents (fronts.grpc_server).
AnswerTensor = tuple[str, str, tuple[int, ...], Any]


#: The numpy dtype a datatype's values are read as (None: as the JSON numbers are).
DtypeOf = Callable[[str], Any]


def decode_outputs(body: bytes, header_length: int | None, dtype_of: DtypeOf) -> tuple[str, list[AnswerTensor]]:
    """(model_version or "", every output in the answer's order) of a 200 answer, each output's values
    read as `dtype_of(datatype)`; raises ValueError (sidecar._dataplane.AnswerNotV2) for an answer
    that is not v2, or a binary section that does not fit its dtype."""
    version, outputs = _dataplane.decode_answer(body, header_length)
    return version or "", [(name, datatype, tuple(shape), _array(values, dtype_of(datatype)))
                           for name, datatype, shape, values in outputs]


def _array(values: Any, dtype: Any) -> np.ndarray:
    import numpy as np

    if isinstance(values, list):  # BYTES: bytes from a binary section, str from JSON
        return np.array(values, dtype=np.object_)
    read_as, data = values
    if read_as is None:
        return np.frombuffer(data, dtype=dtype)
    numbers = np.frombuffer(data, dtype=read_as)
    return numbers if dtype is None else numbers.astype(dtype)


def answer_tensors(body: bytes, header_length: int | None) -> tuple[str, list[AnswerTensor]]:
    """(model_version, numeric outputs) of a 200 answer; ("", []) for anything unexpected: this
    only measures, it never judges an answer (screening does)."""
    try:
        version, outputs = _dataplane.decode_answer(body, header_length)
        return version or "", [(name, datatype, tuple(shape), _array(values, BINARY_DTYPES[datatype]))
                               for name, datatype, shape, values in outputs if datatype in BINARY_DTYPES]
    except ValueError:  # not v2, or a binary section that does not fit its datatype
        return "", []
