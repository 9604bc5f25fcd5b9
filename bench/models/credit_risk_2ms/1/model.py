"""credit_risk (same weights, same answers) whose execute() takes 2 ms longer per batch.

The 2 ms is a sleep: it stands for a GPU model's time on the device, during which the host CPU is
idle (see bench/models/README.md).
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

#: Device time (s) of one batch for a small GPU model.
EXECUTE_S = 0.002


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class TritonPythonModel:
    def initialize(self, args):
        rng = np.random.default_rng(20261202)
        self.w = (rng.standard_normal(128) / np.sqrt(128)).astype(np.float32)
        self.v = (rng.standard_normal(128) / np.sqrt(128)).astype(np.float32)
        self.b = np.float32(-0.25)

    def execute(self, requests):
        time.sleep(EXECUTE_S)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "features").as_numpy()
            if not np.all(np.isfinite(x)):
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(
                            "features must be finite numbers", pb_utils.TritonError.INVALID_ARG
                        )
                    )
                )
                continue
            scores = _sigmoid(x @ self.w + self.b).astype(np.float32).reshape(-1, 1)
            income = _sigmoid(x @ self.v).astype(np.float32).reshape(-1, 1)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("scores", scores),
                        pb_utils.Tensor("income_prob", income),
                    ]
                )
            )
        return responses
