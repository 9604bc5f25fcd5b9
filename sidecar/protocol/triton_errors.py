"""Triton's errors, typed where they are read: the one place that reads Triton's words."""

from __future__ import annotations

import re
from collections.abc import Sequence

#: Longest Triton message we keep in our own errors and logs; Triton's shape errors run long.
MAX_ERROR_CHARS = 300


class TritonUnavailable(Exception):
    """Triton did not answer: connection refused or reset, or no answer within the bound."""


class TritonTimeout(TritonUnavailable):
    """No answer within the call's time limit (the connection itself was fine)."""


class TritonError(Exception):
    """Triton answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message


class StubUnhealthy(TritonError):
    """Triton declares the model instance's python-backend stub process dead. Final: every request to
    that instance fails until it is reloaded, and the instance never finishes unloading once requests
    reached it (it holds no memory any more)."""


def triton_error(status: int, message: str) -> TritonError:
    """The error for an answer of Triton's, typed by what Triton says it is. Triton 2.51's python
    backend answers 500 "Stub process 'NAME_0_0' is not healthy." about a second after its stub died."""
    if "Stub process" in message and "is not healthy" in message:
        return StubUnhealthy(status, message)
    return TritonError(status, message)



#: CUDA's sticky errors, in the words of the CUDA runtime (cudaGetErrorString) that backends pass on
#: in their error text (PyTorch: "CUDA error: an illegal memory access was encountered"). The CUDA
#: runtime API documents each as leaving "the process in an inconsistent state": every later CUDA call
#: in that process fails with the same error, so only a new process (a restart of Triton's container)
#: recovers; a reload of the model cannot. Triton's users meet them as triton-inference-server/server
#: #7164, #5765 and #3627. `healing.process_fault_patterns` adds patterns of one's own.
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress (700)
    "device-side assert triggered",  # cudaErrorAssert (710)
    "unspecified launch failure",  # cudaErrorLaunchFailure (719)
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout (702)
    "hardware stack error",  # cudaErrorHardwareStackError (714)
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction (715)
    "misaligned address",  # cudaErrorMisalignedAddress (716)
    "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace (717)
    "invalid program counter",  # cudaErrorInvalidPc (718)
    "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable (214)
)


_STICKY = tuple(re.compile(re.escape(text), re.IGNORECASE) for text in STICKY_CUDA_ERRORS)


def sticky_error(message: str, extra: Sequence[re.Pattern[str]] = ()) -> str | None:
    """The sticky error Triton's message names (the matched text, lower case), or None. `extra`: the patterns of
    `healing.process_fault_patterns`, compiled case-insensitive."""
    for pattern in (*_STICKY, *extra):
        found = pattern.search(message)
        if found:
            return found.group(0).lower()
    return None


def mentions_cuda(message: str) -> bool:
    """A CUDA error of any kind: one that outlives a fresh instance of the model lives in the process."""
    return "cuda" in message.lower()
