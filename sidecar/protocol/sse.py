"""Server-sent events as Triton's generate_stream writes them: split, frame, read text."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def text_of(doc: Mapping[str, Any], name: str) -> str:
    """A text field of one answer (a string, or a list of strings joined)."""
    value = doc.get(name, "")
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else str(value)


class EventSplitter:
    """Server-sent events out of a byte stream, each as soon as its blank line arrives."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The `data` of every event completed by `chunk` (comment-only events are skipped)."""
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            data = _event_data(buffer[start:end])
            start = end + 2
            if data is not None:
                yield data
        self._buffer = buffer[start:]

    @property
    def pending(self) -> bool:
        """Bytes of an event that has not ended (a stream cut off mid-event)."""
        return bool(self._buffer.strip())


def _event_data(block: bytes) -> bytes | None:
    if block.startswith(b"data: ") and b"\n" not in block:
        return block[6:]  # the one-line event Triton writes
    lines = [line[5:].lstrip(b" ") if line.startswith(b"data:") else None for line in block.split(b"\n")]
    data = [line for line in lines if line is not None]
    return b"\n".join(data) if data else None


def sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
