"""Every answer the sidecar gives itself instead of Triton's, whatever the wire.

One `Reason` per cause of refusal. Its value is the label clients read in the `reason` field (HTTP
body, gRPC trailing metadata) and operators see in `proxy_rejections_total{reason}`; each carries
the HTTP status and the gRPC status code (by name: this module imports neither aiohttp nor grpc)
that the two fronts answer with.

`UpstreamFailure` is the other direction: what went wrong between the sidecar and Triton, said the
same way by both fronts, so the serving core maps it to one refusal and one passive signal.
"""

from __future__ import annotations

import enum
from typing import Any


class Reason(str, enum.Enum):
    """Why the sidecar answered itself: (label, HTTP status, gRPC status code name)."""

    http_status: int
    grpc_code: str

    def __new__(cls, label: str, http_status: int, grpc_code: str) -> Reason:
        member = str.__new__(cls, label)
        member._value_ = label
        member.http_status = http_status
        member.grpc_code = grpc_code
        return member

    def __str__(self) -> str:
        return self.value

    # The request itself: the client can fix these.
    MALFORMED = ("malformed", 400, "INVALID_ARGUMENT")  # not JSON, bad header, duplicate keys
    SCHEMA = ("schema", 400, "INVALID_ARGUMENT")  # not the v2 protocol's structure
    UNKNOWN_INPUT = ("unknown_input", 400, "INVALID_ARGUMENT")
    MISSING_INPUT = ("missing_input", 400, "INVALID_ARGUMENT")
    DATATYPE = ("datatype", 400, "INVALID_ARGUMENT")
    SHAPE = ("shape", 400, "INVALID_ARGUMENT")  # rank, fixed dims, batch size, data length or byte size
    NON_FINITE = ("non_finite", 400, "INVALID_ARGUMENT")  # NaN or ±Inf, or a value that overflows to ±Inf
    OUT_OF_RANGE = ("out_of_range", 400, "INVALID_ARGUMENT")  # an integer that does not fit its dtype
    BYTES_TOO_LONG = ("bytes_element_too_long", 400, "INVALID_ARGUMENT")
    PARAMETER = ("parameter", 400, "INVALID_ARGUMENT")  # a parameter of the wrong type
    UNKNOWN_OUTPUT = ("unknown_output", 400, "INVALID_ARGUMENT")
    BUSINESS_RULE = ("business_rule", 400, "INVALID_ARGUMENT")  # the model's JSON Schema or x-tensors rules
    UNKNOWN_FIELD = ("unknown_field", 400, "INVALID_ARGUMENT")  # generate: neither an input nor a parameter
    TOO_MANY_TOKENS = ("too_many_tokens", 400, "INVALID_ARGUMENT")  # generate: max_tokens over the ceiling
    # generate on a model that streams several responses (Triton answers 200 with an error body)
    STREAMING_MODEL = ("streaming_model", 400, "INVALID_ARGUMENT")
    UNSUPPORTED_MEDIA_TYPE = ("unsupported_media_type", 415, "INVALID_ARGUMENT")
    BODY_TOO_LARGE = ("body_too_large", 413, "RESOURCE_EXHAUSTED")
    TOO_MANY_ELEMENTS = ("too_many_elements", 413, "RESOURCE_EXHAUSTED")
    BODY_TIMEOUT = ("body_timeout", 408, "DEADLINE_EXCEEDED")  # the client sent its body too slowly
    HEADER_TIMEOUT = ("header_timeout", 408, "DEADLINE_EXCEEDED")  # the request's headers came too slowly
    URL_TOO_LONG = ("url_too_long", 414, "INVALID_ARGUMENT")  # a request target over listen.max_url_bytes
    HEADERS_TOO_LARGE = ("headers_too_large", 431, "INVALID_ARGUMENT")  # listen.max_header_bytes or max_headers
    # What the pod does not let through.
    FILTERED_OUTPUT = ("filtered_output", 403, "PERMISSION_DENIED")  # an output that never leaves the pod
    SHARED_MEMORY = ("shared_memory", 403, "PERMISSION_DENIED")  # shared-memory tensors stay inside the pod
    FORBIDDEN_ENDPOINT = ("forbidden_endpoint", 403, "PERMISSION_DENIED")  # Triton's control API
    UNKNOWN_MODEL = ("unknown_model", 404, "NOT_FOUND")  # not a model (version) the sidecar guards
    UNKNOWN_PATH = ("unknown_path", 404, "UNIMPLEMENTED")
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, "UNIMPLEMENTED")
    # The model or Triton cannot be trusted or reached right now: retry later.
    QUARANTINED = ("quarantined", 503, "UNAVAILABLE")
    NOT_VERIFIED = ("not_verified", 503, "UNAVAILABLE")  # not probed yet (start-up)
    MODEL_UNAVAILABLE = ("model_unavailable", 503, "UNAVAILABLE")  # tracked, but Triton does not serve it
    NOT_READY = ("not_ready", 503, "UNAVAILABLE")  # health endpoints
    OVERLOADED = ("overloaded", 503, "RESOURCE_EXHAUSTED")  # the model's breaker is full
    TRITON_UNREACHABLE = ("triton_unreachable", 503, "UNAVAILABLE")
    TRITON_ERROR = ("triton_error", 502, "INTERNAL")  # Triton answered with a server error
    TRITON_BAD_ANSWER = ("triton_bad_answer", 502, "INTERNAL")  # connection dropped, or not a v2 answer
    NON_FINITE_OUTPUT = ("non_finite_output", 502, "INTERNAL")  # NaN/Inf answer withheld
    TRITON_TIMEOUT = ("triton_timeout", 504, "DEADLINE_EXCEEDED")
    # A stream that began and then went silent for generation.idle_timeout_s (an error event, as the
    # status was already sent).
    STREAM_IDLE = ("stream_idle", 504, "DEADLINE_EXCEEDED")
    # An unexpected exception inside the sidecar (a bug): logged with its traceback, counted in
    # proxy_internal_errors_total (sidecar.serving.request decides it, for every front).
    INTERNAL_ERROR = ("internal_error", 500, "INTERNAL")
    # Counted, never seen by the client (499 is nginx's code for it).
    CLIENT_GONE = ("client_disconnected", 499, "CANCELLED")


class Refusal(Exception):
    """An answer the sidecar gives itself: a reason, and a message a person can act on.

    `before_triton` is True when nothing reached Triton (counted in proxy_rejections_total);
    `extra` fields are added to the HTTP JSON body (input, state, outputs, ...)."""

    def __init__(self, reason: Reason, message: str, *, model: str = "", retry_after: int | None = None,
                 before_triton: bool = True, **extra: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.model = model
        self.retry_after = retry_after
        self.before_triton = before_triton
        self.extra = extra

    @property
    def status(self) -> int:
        return self.reason.http_status

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.message, "reason": self.reason.value}
        if self.model:
            body["model"] = self.model
        body.update(self.extra)
        return body


class FailureKind(enum.Enum):
    TIMEOUT = "timeout"  # no answer within the bound
    UNREACHABLE = "unreachable"  # no connection: Triton is down or restarting
    DROPPED = "dropped"  # the connection broke after the request was sent, or the answer is not v2
    SERVER_ERROR = "server_error"  # Triton answered with a server error (HTTP 5xx, gRPC INTERNAL/UNKNOWN)


class UpstreamFailure(Exception):
    """A proxied call to Triton that did not give a usable answer, as either front saw it.

    `status` is Triton's HTTP status for SERVER_ERROR (0 when the answer came over gRPC) and
    `detail` the transport's or Triton's own words, cut short. `stub_dead`: the front found Triton's
    answer to be its verdict that the model instance's stub died (sidecar.triton.StubUnhealthy)."""

    def __init__(self, kind: FailureKind, detail: str = "", *, status: int = 0, stub_dead: bool = False) -> None:
        super().__init__(detail or kind.value)
        self.kind = kind
        self.detail = detail
        self.status = status
        self.stub_dead = stub_dead
