"""A deterministic decoupled text model: one event per word of `text_input`.

Each response carries one word in `text_output` (with the space before it, so that the concatenation
over all events is the input's first `max_tokens` words), sent every `delay_ms` milliseconds like a
token stream. Every request streams on its own thread, so concurrent streams do not wait on each other.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

#: Words streamed when the request sets no max_tokens.
DEFAULT_MAX_TOKENS = 64


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.delay_s = float(config["parameters"]["delay_ms"]["string_value"]) / 1000.0
        self.threads = []

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._stream, args=(request,), daemon=True)
            thread.start()
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        return None

    def _stream(self, request):
        sender = request.get_response_sender()
        try:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            text = text.decode() if isinstance(text, bytes) else str(text)
            limit_tensor = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            limit = int(limit_tensor.as_numpy().reshape(-1)[0]) if limit_tensor is not None else DEFAULT_MAX_TOKENS
            words = text.split()[: max(limit, 0)]
            for i, word in enumerate(words):
                time.sleep(self.delay_s)
                piece = word if i == 0 else " " + word
                out = pb_utils.Tensor("text_output", np.array([piece.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # the client must get an error, not a stream that never ends
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=5)
