"""Faults injected into a running model, the bench-side twin of tests/harness.FreshModel: the model is
a copy of tests/models/faulty (credit_risk with SIGUSR1 fault hooks), loaded under its own name."""

from __future__ import annotations

import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from sidecar.devtools.tritonserver import LocalTriton, stub_pids

#: Every kind the soak cycles through, fastest to heal first (a short soak still sees several).
FAULT_KINDS = ("nan", "drift", "unload", "kill", "hang")
#: Not a fault the soak waits to see healed: one golden round fails by chance (bench/hold_cost.py).
PROBE_BLIP = "probe_blip"


@dataclass
class FaultyModel:
    triton: LocalTriton
    name: str
    path: Path

    def stubs(self) -> list[int]:
        return stub_pids(self.name, parent=self.triton.pid)

    def inject(self, kind: str) -> str:
        """Break the model the way `kind` says; returns what was done, for the report."""
        if kind == "kill":
            pids = self.stubs()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return f"SIGKILL stub {pids}"
        if kind == "unload":
            # Someone else (an operator, a CI job) unloads the model behind the sidecar's back.
            request = urllib.request.Request(f"{self.triton.url}/v2/repository/models/{self.name}/unload",
                                             data=b"{}", method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                return f"POST unload -> {response.status}"
        if kind in ("nan", "drift", "hang", PROBE_BLIP):
            (self.path / "1" / "fault").write_text(kind)
            pids = self.stubs()
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)  # the stub damages its own memory (tests/models/faulty)
            return f"SIGUSR1 {kind} to stub {pids}"
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")


#: What each kind does, for the report.
FAULT_DESCRIPTIONS = {
    "nan": "the stub's weights become NaN in memory (every answer NaN until reloaded)",
    "drift": "the stub's weights are scaled (finite but wrong answers until reloaded)",
    "unload": "the model is unloaded from Triton by someone else",
    "kill": "SIGKILL of the model's python backend stub",
    "hang": "every later execute() blocks forever (the stub stays alive)",
    PROBE_BLIP: "the next golden boundary request answers wrong once (clients' answers stay right)",
}
