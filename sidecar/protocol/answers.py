"""The tensors of a KServe v2 infer answer over HTTP (JSON, or JSON header + binary sections), decoded
for measuring (the drift monitor, record-reference). The answer's bytes are never changed here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import rapidjson

#: Little-endian numpy dtypes of the fixed-size numeric datatypes (Triton's binary extension).
BINARY_DTYPES = {"UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "<i1", "INT16": "<i2",
                 "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


#: (name, datatype, shape, values): values a numpy array, or a memoryview of binary data.
AnswerTensor = tuple[str, str, tuple[int, ...], Any]


def answer_tensors(body: bytes, header_length: int | None) -> tuple[str, list[AnswerTensor]]:
    """(model_version, numeric outputs) of a 200 answer; ([], "") for anything unexpected: this
    only measures, it never judges an answer (screening does)."""
    try:
        header = body if header_length is None else body[:header_length]
        doc = rapidjson.loads(header, number_mode=rapidjson.NM_NATIVE | rapidjson.NM_NAN)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "", []
    if not isinstance(doc, dict) or not isinstance(doc.get("outputs"), list):
        return "", []
    version = doc.get("model_version")
    version = version if isinstance(version, str) else ""
    tensors: list[AnswerTensor] = []
    view = memoryview(body)
    offset = header_length or 0
    for output in doc["outputs"]:
        if not isinstance(output, dict):
            return version, tensors
        datatype, name = output.get("datatype"), output.get("name")
        shape = tuple(output.get("shape") or ())
        size = (output.get("parameters") or {}).get("binary_data_size")
        if isinstance(size, int) and header_length is not None:
            chunk = view[offset: offset + size]
            offset += size
            if datatype in BINARY_DTYPES and isinstance(name, str):
                tensors.append((name, datatype, shape, chunk))
        elif datatype in BINARY_DTYPES and isinstance(name, str) and isinstance(output.get("data"), list):
            try:
                tensors.append((name, datatype, shape, np.asarray(output["data"], dtype=np.float64)))
            except (ValueError, TypeError):
                continue
    return version, tensors
