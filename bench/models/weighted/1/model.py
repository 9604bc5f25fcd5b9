"""A model whose load does real work: read a weights file of a few hundred MB, check its SHA-256,
and derive the 128 weights actually used from all of it (a column sum), as a real model's load reads
and checks its whole checkpoint.

Files next to this one, written by bench/recovery.py: `weights.f32` (raw little-endian float32, a
multiple of 128 values) and `weights.sha256` (hex digest of weights.f32).
"""

import hashlib
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def derive_weights(raw):
    """128 weights from the whole file; bench/recovery.py computes the same to know the answers."""
    table = np.frombuffer(raw, dtype="<f4").reshape(-1, 128)
    return (table.sum(axis=0, dtype=np.float64) / np.sqrt(table.shape[0] * 128)).astype(np.float32)


class TritonPythonModel:
    def initialize(self, args):
        here = Path(__file__).parent
        raw = (here / "weights.f32").read_bytes()
        expected = (here / "weights.sha256").read_text().strip()
        actual = hashlib.sha256(raw).hexdigest()
        if actual != expected:
            raise pb_utils.TritonModelException(
                f"weights.f32 is corrupt: sha256 {actual}, expected {expected}"
            )
        self.w = derive_weights(raw)
        if not np.all(np.isfinite(self.w)):
            raise pb_utils.TritonModelException("weights.f32 holds non-finite values")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "features").as_numpy()
            scores = _sigmoid(x @ self.w).astype(np.float32).reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("scores", scores)]))
        return responses
