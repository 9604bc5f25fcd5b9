"""Parts of the process that must keep turning on threads of their own, for the watchdog of /healthz.

The health loop's own tasks are watched through their rounds (supervisors, the Triton watch). What
runs outside the event loop (the data plane's HTTP front, on its runtime threads) registers here how
long it has been silent; /healthz and /readyz fail naming one silent longer than
`liveness.watchdog_stall_s`: a deadlocked runtime serves nobody, and only a restart ends it.
"""

from __future__ import annotations

from collections.abc import Callable


class Heartbeats:
    def __init__(self) -> None:
        self._silent_for: dict[str, Callable[[], float]] = {}

    def watch(self, name: str, silent_for: Callable[[], float]) -> None:
        """`silent_for()`: seconds since `name` last showed it turns."""
        self._silent_for[name] = silent_for

    def forget(self, name: str) -> None:
        self._silent_for.pop(name, None)

    def problems(self, bound_s: float) -> list[str]:
        out = []
        for name, silent_for in self._silent_for.items():
            silent = silent_for()
            if silent > bound_s:
                out.append(f"{name} stalled: silent for {silent:.0f} s (bound {bound_s:g} s, "
                           "liveness.watchdog_stall_s)")
        return out
