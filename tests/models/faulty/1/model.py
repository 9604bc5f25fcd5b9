"""The credit_risk model, plus real in-process faults that tests trigger with SIGUSR1.

On SIGUSR1 the stub reads `fault` next to this file and damages its own state accordingly:
- `nan`: the weights become NaN in memory, so every answer is NaN until the model is reloaded;
- `drift`: the weights are scaled, so answers are finite but wrong, until reloaded;
- `hang`: every later execute() blocks forever (the stub process stays alive);
- `slow_drift`: as `drift`, and every later execute() takes 0.2 s more (a confirmation round that
  can be waited on);
- `blip`: the next execute() answers wrong once, and the three after it take 0.2 s more each (a
  transient fault whose confirmation round passes, slowly enough to be waited on);
- `probe_blip`: the next request holding a row of zeros (the golden `boundary` case has one; random
  client inputs never do) answers wrong once: a golden round that fails by chance while every client
  answer stays right (bench/hold_cost.py).
A reload runs initialize() again in a fresh stub, which is what heals each of these.

A file `load_delay_s` next to this one makes initialize() take that many seconds more: a heal whose
load is slow (tests/test_healing.py, a load that must not stall the other models).
"""

import signal
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class TritonPythonModel:
    def initialize(self, args):
        delay = Path(__file__).parent / "load_delay_s"
        if delay.exists():
            time.sleep(float(delay.read_text()))
        rng = np.random.default_rng(20261202)
        self.w = (rng.standard_normal(128) / np.sqrt(128)).astype(np.float32)
        self.v = (rng.standard_normal(128) / np.sqrt(128)).astype(np.float32)
        self.b = np.float32(-0.25)
        self.hang = False
        self.delay_s = 0.0
        self.slow_calls = 0
        self.wrong_calls = 0
        self.probe_blips = 0
        self.error_text = ""
        self.raise_text = ""
        self.fault_file = Path(__file__).parent / "fault"
        signal.signal(signal.SIGUSR1, self._inject_fault)

    def _inject_fault(self, signum, frame):
        kind = self.fault_file.read_text().strip()
        if kind == "nan":
            self.w = np.full_like(self.w, np.nan)
        elif kind == "drift":
            self.w = self.w * np.float32(3.0)
            self.b = np.float32(2.0)
        elif kind == "hang":
            self.hang = True
        elif kind == "slow_drift":
            self.w = self.w * np.float32(3.0)
            self.b = np.float32(2.0)
            self.delay_s = 0.2
        elif kind == "blip":
            self.wrong_calls = 1
            self.slow_calls = 3
        elif kind == "probe_blip":
            self.probe_blips = 1
        elif kind.startswith("error:"):
            self.error_text = kind[len("error:"):]
        elif kind.startswith("raise:"):
            self.raise_text = kind[len("raise:"):]

    def execute(self, requests):
        if self.hang:
            threading.Event().wait()
        if self.raise_text:
            raise RuntimeError(self.raise_text)
        if self.error_text:
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(self.error_text)) for _ in requests]
        if self.delay_s:
            time.sleep(self.delay_s)
        wrong = self.wrong_calls > 0
        if wrong:
            self.wrong_calls -= 1
        elif self.slow_calls:
            self.slow_calls -= 1
            time.sleep(0.2)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "features").as_numpy()
            if not np.all(np.isfinite(x)):
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("features must be finite numbers")
                    )
                )
                continue
            scores = _sigmoid(x @ self.w + self.b).astype(np.float32).reshape(-1, 1)
            if wrong or (self.probe_blips and np.any(np.all(x == 0, axis=1))):
                if not wrong:
                    self.probe_blips -= 1
                scores = _sigmoid(x @ self.w + np.float32(5.0)).astype(np.float32).reshape(-1, 1)
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
