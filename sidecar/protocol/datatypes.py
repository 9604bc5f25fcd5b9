"""The KServe v2 tensor datatypes and their numpy equivalents.

numpy is imported only when a numpy dtype is asked for (the gRPC front, rollouts, drift, the
record commands, tests): the health loop reads and compares answers through the data plane
(sidecar._dataplane.read_answer, compare_output), and numpy costs several MB of RSS in every idle
sidecar (issue 30).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

#: The datatypes golden files may name (BF16 has no numpy dtype of its own).
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
             "BYTES")


FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64"})


@functools.cache
def numpy_dtypes() -> Mapping[str, Any]:
    """The numpy type of each of DATATYPES."""
    import numpy as np

    return {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
            "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
            "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}


def numpy_dtype(datatype: str) -> Any:
    """The numpy dtype of a v2 datatype, as tritonclient.utils.triton_to_np_dtype gives it (None for
    an unknown one). BF16 is ml_dtypes.bfloat16, imported only when met: ml_dtypes costs 3.4 MB of
    RSS in every sidecar, and BF16 golden cases are rare."""
    if datatype == "BOOL":
        return bool
    if datatype == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return numpy_dtypes().get(datatype)


def v2_datatype(dtype: np.dtype) -> str | None:
    """The v2 datatype of a numpy dtype, as tritonclient.utils.np_to_triton_dtype names it."""
    import numpy as np

    if dtype == np.object_ or dtype.type == np.bytes_:
        return "BYTES"
    if dtype.name == "bfloat16":
        return "BF16"
    for datatype, numpy in numpy_dtypes().items():
        if datatype != "BYTES" and dtype == numpy:
            return datatype
    return None
