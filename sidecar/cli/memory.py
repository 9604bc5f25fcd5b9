"""Give the heap's free pages back once start-up is over.

Importing the package, reading the config and golden files, and the first probe rounds allocate and
free a few megabytes of short-lived objects; glibc keeps the freed pages in the process (they count
in its RSS, which the pod's memory limit and issue 30's idle bound measure) until asked to return
them. Asked twice: when the listeners are up, and once the first probe rounds are done. (The
compiled data plane allocates through mimalloc, which returns its freed pages by itself.)
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

#: After the start, when the first rounds of every model's probes are usually done (probes every 5 s).
SETTLED_S = 15.0


def release_freed_memory() -> None:
    """malloc_trim(0) where the C library has it (glibc); nothing elsewhere (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_after_start(loop: asyncio.AbstractEventLoop) -> None:
    release_freed_memory()
    loop.call_later(SETTLED_S, release_freed_memory)
