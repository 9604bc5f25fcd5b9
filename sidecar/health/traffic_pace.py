"""Rounds paced by traffic (`probes.every_requests`): the live requests a model has served since its
last round began, and when its supervisor should look at that count again.

A silent fault (finite, plausible, wrong answers) is caught only by the next golden round. Paced by
time alone, the wrong answers it reaches grow with the load; paced by traffic as well, a round
starts once N requests were served since the last one began, so the fault reaches about N requests
(plus those served while the failing round runs) whatever the load.

The count comes from the data plane's own per-model request counters (`served(model, version)`,
given by the app: sidecar.app.request_counters), read by the waiting supervisor: the request path
does nothing more. Why a poll and not a threshold callback: measured (`python -m bench.pacing_cost`,
bench/RESULTS.md §5e), a look costs about 3 us and a per-request count-and-compare about 0.2 us, so
at 2,000 req/s to one model paced every 50 (10 models, 9 idle) the poll takes 0.06 % of a core and
the callback 0.04 %: the same, negligibly, against the rounds themselves. The callback's share is
paid on the request path of every request of every model, pacing on or off, and once the counters
live in the compiled data plane it would be a call back into Python per threshold; the poll is paid
by the supervisor only, and only with pacing on: a look right after each round and one aimed at the
moment the count should reach N from the rate seen since (two or three per round while traffic
flows), and one every POLL_IDLE_S while no request comes.

A model whose traffic goes through several versions counts per version that has golden cases of
its own: a round starts when any of them has served N requests (a round probes every version).
Unversioned cases count the requests that reach the version Triton picks for unversioned ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sidecar.golden.cases import GoldenCase
from sidecar.states import ModelHealth

#: (model, version) -> requests served since start: every version with "", else those the router
#: sent to that version by name (pin, split, fallback).
ServedRequests = Callable[[str, str], int]


#: Shortest wait (s) between two looks while traffic flows: at 2,000 req/s that is 4 requests, small
#: against any useful N, and at most 500 looks a second of a few microseconds each.
POLL_MIN_S = 0.002


#: Wait (s) between two looks while no request came since the last one: traffic that starts is
#: seen within 0.1 s; an idle model costs 10 looks a second, and none with pacing off.
POLL_IDLE_S = 0.1


class TrafficCount:
    """One model's live requests since its last round began, per version with golden cases."""

    def __init__(self, model: str, served: ServedRequests, *, cases_for: Callable[[str], Sequence[GoldenCase]],
                 health: Callable[[], ModelHealth], clock: Callable[[], float]) -> None:
        self.model = model
        self._served = served
        self._cases_for = cases_for
        self._health = health
        self._clock = clock
        #: Counts per probed version when the last round began (None: no round yet).
        self._base: dict[str, int] | None = None
        #: clock() when the last round began.
        self.marked_at = 0.0
        #: (clock(), since()) at the last look, for the rate.
        self._last_look = (0.0, 0)

    @property
    def counting(self) -> bool:
        """A round has begun: there is a count since it."""
        return self._base is not None

    @property
    def looked_at(self) -> float:
        """clock() of the supervisor's last look at the count (or of the round's start)."""
        return self._last_look[0]

    @property
    def probed(self) -> bool:
        """The model has golden cases: there is something for a traffic-paced round to check."""
        return bool(self._cases_for(self.model))

    def mark(self) -> None:
        """A round begins: count from here."""
        self._base = self._counts()
        self.marked_at = self._clock()
        self._last_look = (self.marked_at, 0)

    def since(self) -> int | None:
        """Requests served since the last round began, on the busiest probed version (None before
        the first round)."""
        if self._base is None:
            return None
        counts = self._counts()
        return max((counts[v] - self._base.get(v, counts[v]) for v in counts), default=0)

    def next_look(self, every: int, since: int) -> float:
        """Seconds until the count should reach `every`, from the rate since the last look, within
        [POLL_MIN_S, POLL_IDLE_S]."""
        now = self._clock()
        at, seen = self._last_look
        self._last_look = (now, since)
        if since <= seen or now <= at:
            return POLL_IDLE_S
        rate = (since - seen) / (now - at)
        return min(POLL_IDLE_S, max(POLL_MIN_S, (every - since) / rate))

    def _counts(self) -> dict[str, int]:
        """Requests served so far per probed version ("" for unversioned cases)."""
        versions = {case.version for case in self._cases_for(self.model)}
        total = self._served(self.model, "")
        if versions <= {""}:
            return {"": total}  # the common case: one read
        health = self._health()
        default = health.default_version
        named = {v: self._served(self.model, v) for v in set(health.loaded_versions) | versions if v}
        unnamed = max(0, total - sum(named.values()))  # sent unversioned: Triton's default version
        counts = {}
        for version in versions:
            reached = version or default
            counts[version] = named.get(reached, 0) + (unnamed if reached == default else 0)
        return counts
