"""Decoupled: COUNT responses per request, each sent as soon as it is made, 50 ms apart."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

DELAY_S = 0.05


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            nan = count > 100
            sender = request.get_response_sender()
            for i in range(count - 100 if nan else count):
                if i:
                    time.sleep(DELAY_S)
                if sender.is_cancelled():
                    # What the stream tests read in Triton's log: the client's cancel reached the model.
                    pb_utils.Logger.log_info(f"decoupled_counter: cancelled after {i} responses")
                    break
                value = np.array([np.nan if nan else i / 2], dtype=np.float32)
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("VALUE", value), pb_utils.Tensor("SECRET", np.array([42.0], dtype=np.float32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
