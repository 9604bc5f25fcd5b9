"""The KServe v2 tensor datatypes and their numpy equivalents."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

NUMPY_DTYPES: Mapping[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}


FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64"})


def numpy_dtype(datatype: str) -> Any:
    """The numpy dtype of a v2 datatype, as tritonclient.utils.triton_to_np_dtype gives it (None for
    an unknown one). BF16 is ml_dtypes.bfloat16, imported only when met: ml_dtypes costs 3.4 MB of
    RSS in every sidecar, and BF16 golden cases are rare."""
    if datatype == "BOOL":
        return bool
    if datatype == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return NUMPY_DTYPES.get(datatype)


def v2_datatype(dtype: np.dtype) -> str | None:
    """The v2 datatype of a numpy dtype, as tritonclient.utils.np_to_triton_dtype names it."""
    if dtype == np.object_ or dtype.type == np.bytes_:
        return "BYTES"
    if dtype.name == "bfloat16":
        return "BF16"
    for datatype, numpy in NUMPY_DTYPES.items():
        if datatype != "BYTES" and dtype == numpy:
            return datatype
    return None

