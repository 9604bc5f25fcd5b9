"""The text_echo model, plus real in-process faults that tests trigger with SIGUSR1.

On SIGUSR1 the stub reads `fault` next to this file:
- `wrong`: every word is streamed reversed (finite, well-formed, wrong answers) until reloaded;
- `stall`: every stream stops after its first event and never ends (the stub stays alive);
- `nan`: the `logprob` output of every event is NaN.
A reload runs initialize() again in a fresh stub, which is what heals each of these.
"""

import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.delay_s = float(config["parameters"]["delay_ms"]["string_value"]) / 1000.0
        self.fault = ""
        self.fault_file = Path(__file__).parent / "fault"
        signal.signal(signal.SIGUSR1, self._inject_fault)

    def _inject_fault(self, signum, frame):
        self.fault = self.fault_file.read_text().strip()

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._stream, args=(request,), daemon=True).start()
        return None

    def _stream(self, request):
        sender = request.get_response_sender()
        try:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            text = text.decode() if isinstance(text, bytes) else str(text)
            limit_tensor = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            limit = int(limit_tensor.as_numpy().reshape(-1)[0]) if limit_tensor is not None else 64
            for i, word in enumerate(text.split()[: max(limit, 0)]):
                if self.fault == "stall" and i == 1:
                    threading.Event().wait()
                time.sleep(self.delay_s)
                if self.fault == "wrong":
                    word = word[::-1]
                piece = word if i == 0 else " " + word
                logprob = np.float32("nan") if self.fault == "nan" else np.float32(-0.5)
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array([piece.encode()], dtype=np.object_)),
                    pb_utils.Tensor("logprob", np.array([logprob], dtype=np.float32)),
                ]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # the client must get an error, not a stream that never ends
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
