"""Image classifier: per-channel means through a fixed linear layer, then softmax over 10 classes.

Deterministic and cheap, so golden requests can pin its answers.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        rng = np.random.default_rng(32)
        self.weights = rng.standard_normal((3, 10)).astype(np.float32)
        self.bias = np.linspace(-0.5, 0.5, 10, dtype=np.float32)

    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "image").as_numpy()
            if images.min() < 0.0 or images.max() > 1.0:
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(
                            "image pixels must lie in [0, 1]", pb_utils.TritonError.INVALID_ARG
                        )
                    )
                )
                continue
            channel_means = images.mean(axis=(2, 3))  # [batch, 3]
            logits = channel_means @ self.weights + self.bias
            logits = logits - logits.max(axis=1, keepdims=True)
            probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("class_scores", probs.astype(np.float32))]
                )
            )
        return responses
