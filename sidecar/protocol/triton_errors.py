"""Triton's errors, typed where they are read: the one place that reads Triton's words."""

from __future__ import annotations

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

