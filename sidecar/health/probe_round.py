"""One probe round of one model: server ready, model ready + metadata, every golden case."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace

from sidecar.golden.cases import GoldenCase
from sidecar.golden.compare import compare_outputs
from sidecar.health.late_answers import LateAnswers, StillUnanswered
from sidecar.health.triton_client import TritonClient
from sidecar.protocol.triton_errors import (
    StubUnhealthy,
    TritonError,
    TritonTimeout,
    TritonUnavailable,
    triton_error,
)

SERVER_READY = "server_ready"


MODEL_READY = "model_ready"


METADATA = "metadata"


GOLDEN = "golden"


@dataclass(frozen=True)
class ProbeResult:
    probe: str
    ok: bool
    duration_s: float
    detail: str = ""
    case: str = ""
    timed_out: bool = False
    #: Triton declared the fault final (StubUnhealthy): only a reload helps.
    final: bool = False
    #: The model version a golden case named ("" = the version the server routes to).
    version: str = ""
    #: Triton's own error message when it answered with an error status ("" otherwise): what the
    #: supervisor's verdict reads to tell a model's fault from the process's (fault_scope).
    error: str = ""
    status: int = 0

    @property
    def result(self) -> str:
        return "success" if self.ok else "timeout" if self.timed_out else "failure"


@dataclass(frozen=True)
class RoundResult:
    """One probe round of one model. `conclusive` is False when Triton itself did not answer:
    a model cannot be judged (nor healed) while its server is down."""

    model: str
    results: tuple[ProbeResult, ...] = ()
    conclusive: bool = True
    started_at: float = 0.0
    duration_s: float = 0.0
    #: What the round could not check and why (e.g. metadata that declares no inputs): warnings.
    notes: tuple[str, ...] = ()
    #: The versions the model's metadata lists as available (Triton: every loaded version).
    versions: tuple[str, ...] = ()

    @property
    def default_version(self) -> str:
        """The version unversioned requests reach: Triton routes them to the highest loaded one."""
        numbered = [v for v in self.versions if v.isdigit()]
        return max(numbered, key=int) if numbered else ""

    @property
    def broken_versions(self) -> frozenset[str]:
        """The versions a failed golden case blames; empty = the whole model (its readiness or
        metadata failed, or the failed case's version is unknown)."""
        failed = next((r for r in self.results if not r.ok), None)
        if failed is None or failed.probe != GOLDEN:
            return frozenset()
        version = failed.version or self.default_version
        return frozenset({version}) if version else frozenset()

    @property
    def ok(self) -> bool:
        return self.conclusive and all(r.ok for r in self.results)

    @property
    def final(self) -> bool:
        return any(r.final for r in self.results)

    @property
    def failure(self) -> ProbeResult | None:
        """The probe that failed the round (a round stops at its first failure), or None."""
        return next((r for r in self.results if not r.ok), None)

    @property
    def cause(self) -> str:
        failed = self.failure
        if failed is None:
            return "all probes passed"
        where = f"golden case {failed.case}" if failed.case else failed.probe.replace("_", " ")
        return f"{where}: {failed.detail}"


def round_attributes(result: RoundResult) -> dict[str, str | bool | int]:
    """A round's outcome as span attributes (sidecar.tracing): a probe round's span, a heal's verify."""
    return {"sidecar.probe.ok": result.ok, "sidecar.probe.conclusive": result.conclusive,
            "sidecar.probe.result": result.cause, "sidecar.probe.cases": sum(1 for r in result.results if r.case)}


def probe_events(result: RoundResult) -> list[tuple[str, dict[str, str | bool | float]]]:
    """Each probe of a round as a span event: what was asked, whether it passed, how long it took."""
    events = []
    for probe in result.results:
        attributes: dict[str, str | bool | float] = {"sidecar.probe.ok": probe.ok,
                                                     "sidecar.probe.duration_ms": round(probe.duration_s * 1000, 2)}
        if probe.case:
            attributes["sidecar.probe.case"] = probe.case
        if probe.detail:
            attributes["sidecar.probe.detail"] = probe.detail[:300]
        events.append((probe.probe, attributes))
    return events


class _Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


async def probe_model(
    triton: TritonClient, model: str, cases: Sequence[GoldenCase], *, timeout_s: float,
    stop_at_first_failure: bool = False, late: LateAnswers | None = None,
) -> RoundResult:
    """Run one probe round against a model and say what passed and what did not. The sidecar stops
    at the first failed case (one is enough to judge, and a sick model need not be hit more); the
    `check` command runs every case to report them all. With `late`, a golden request that outlives
    `timeout_s` is kept open for Triton's late verdict; without, it is cancelled."""
    started = time.time()
    results: list[ProbeResult] = []
    notes: list[str] = []
    versions: list[str] = []

    async def step(probe: str, call: Awaitable[str | None], case: str = "", version: str = "") -> ProbeResult:
        timer = _Timer()
        try:
            problem = await call
        except TritonTimeout:
            result = ProbeResult(probe, False, timer.elapsed, f"no answer within {timeout_s:g} s", case, True)
        except StillUnanswered as e:
            result = ProbeResult(probe, False, timer.elapsed, str(e), case, timed_out=True)
        except TritonUnavailable as e:
            result = ProbeResult(probe, False, timer.elapsed, f"Triton unreachable: {e}", case)
        except StubUnhealthy as e:
            result = ProbeResult(probe, False, timer.elapsed, f"Triton answered {e.status}: {e.message}", case,
                                 final=True, error=e.message, status=e.status)
        except TritonError as e:
            result = ProbeResult(probe, False, timer.elapsed, f"Triton answered {e.status}: {e.message}", case,
                                 error=e.message, status=e.status)
        else:
            result = ProbeResult(probe, problem is None, timer.elapsed, problem or "", case)
        if version:
            result = replace(result, version=version)
        results.append(result)
        return result

    def finish(conclusive: bool = True) -> RoundResult:
        return RoundResult(model, tuple(results), conclusive, started, time.time() - started, tuple(notes),
                           tuple(versions))

    server = await step(SERVER_READY, _server_ready(triton, timeout_s))
    if not server.ok:
        return finish(conclusive=False)
    if not (await step(MODEL_READY, _model_ready(triton, model, timeout_s))).ok:
        return finish()
    if not (await step(METADATA, _metadata_matches(triton, model, cases, timeout_s, notes, versions))).ok:
        return finish()
    for case in cases:
        outcome = await step(GOLDEN, _golden_case(triton, case, timeout_s, late), case=case.name,
                             version=case.version)
        if outcome.timed_out or (stop_at_first_failure and not outcome.ok):
            break  # a hung model would make every further case wait the full bound too
    return finish()


async def _server_ready(triton: TritonClient, timeout_s: float) -> str | None:
    # Under strict readiness (Triton's default) one model that failed to load makes the whole server
    # "not ready"; that must not stop the other models from being judged, so live is enough here.
    # The pod's readiness still requires a ready server (TritonWatch).
    if await triton.server_ready(timeout_s) or await triton.server_live(timeout_s):
        return None
    return "Triton answers neither ready nor live"


async def _model_ready(triton: TritonClient, model: str, timeout_s: float) -> str | None:
    if await triton.model_ready(model, timeout_s=timeout_s):
        return None
    return "Triton says the model is not ready (not loaded, unloaded, or failed to load)"


async def _metadata_matches(
    triton: TritonClient, model: str, cases: Sequence[GoldenCase], timeout_s: float, notes: list[str],
    versions: list[str],
) -> str | None:
    metadata = await triton.model_metadata(model, timeout_s=timeout_s)
    versions.extend(str(v) for v in metadata.get("versions") or ())
    declared_inputs = {t["name"]: t["datatype"] for t in metadata.get("inputs", [])}
    declared_outputs = {t["name"]: t["datatype"] for t in metadata.get("outputs", [])}
    # Other v2 servers (MLServer with a custom runtime) may declare nothing: then the golden cases
    # alone judge the model. Declaring nothing is not a fault; declaring something else is.
    for kind, declared in (("inputs", declared_inputs), ("outputs", declared_outputs)):
        if not declared:
            notes.append(f"the model's metadata declares no {kind}: its golden cases alone check them")
    for case in cases:
        if case.text is not None and declared_outputs and case.text.field not in declared_outputs:
            return f"golden case {case.name} reads output {case.text.field!r}, which the model does not declare"
        for name, datatype in case.input_datatypes.items() if declared_inputs else ():
            if name not in declared_inputs:
                return f"golden case {case.name} sends input {name!r}, which the model does not declare"
            if declared_inputs[name] != datatype:
                return (f"golden case {case.name} sends input {name!r} as {datatype}, "
                        f"the model declares {declared_inputs[name]}")
        for name, expected in case.outputs.items() if declared_outputs else ():
            if declared_outputs.get(name) != expected.datatype:
                return (f"golden case {case.name} expects output {name!r} as {expected.datatype}, "
                        f"the model declares {declared_outputs.get(name, 'no such output')}")
    return None


async def _golden_case(triton: TritonClient, case: GoldenCase, timeout_s: float,
                       late: LateAnswers | None) -> str | None:
    if case.is_generate:
        return await _generate_case(triton, case, timeout_s)
    if late is None:
        outcome = await triton.infer_case(case, timeout_s=timeout_s)
    else:
        outcome = await late.infer(triton, case, timeout_s)
    _raise_unexpected_error(case, outcome.status, outcome.error)
    problem = _judge_status(case, outcome.status, outcome.error)
    if problem is not None or case.expects_error:
        return problem
    mismatches = compare_outputs(case, outcome.outputs)
    return "; ".join(str(m) for m in mismatches) if mismatches else None


def _raise_unexpected_error(case: GoldenCase, status: int, error: str) -> None:
    """An error answer to a case that expects none is Triton's error, raised as such so the round keeps
    Triton's words apart from the sidecar's own verdict (the detail reads as _judge_status's would)."""
    if status != 200 and not case.expects_error:
        raise triton_error(status, error)


def _judge_status(case: GoldenCase, status: int, error: str) -> str | None:
    """What is wrong with an answer's status (None: nothing); for an error case, its whole verdict."""
    if case.expects_error:
        if status != case.expect_status:
            got = "a normal answer" if status == 200 else f"{status}: {error}"
            return f"expected a {case.expect_status} rejection, got {got}"
        if case.error_contains and case.error_contains not in error:
            return f"expected the error to mention {case.error_contains!r}, got {error!r}"
        return None
    if status != 200:
        return f"Triton answered {status}: {error}"
    return None


async def _generate_case(triton: TritonClient, case: GoldenCase, timeout_s: float) -> str | None:
    """A generate case: its status, Triton's error events, the text and the time bounds. A stream
    that stalls is cut by timeout_s (the probe then counts as timed out)."""
    outcome = await triton.generate_case(case, timeout_s=timeout_s)
    _raise_unexpected_error(case, outcome.status, outcome.error)
    problem = _judge_status(case, outcome.status, outcome.error)
    if problem is not None or case.expects_error:
        return problem
    if outcome.error:
        return f"Triton's answer ended in an error after {outcome.events} event(s): {outcome.error}"
    if case.max_first_event_s is not None and (outcome.first_event_s is None
                                                or outcome.first_event_s > case.max_first_event_s):
        got = "no event" if outcome.first_event_s is None else f"{outcome.first_event_s:.3f} s"
        return f"first event expected within {case.max_first_event_s:g} s, got {got}"
    if case.max_total_s is not None and outcome.total_s > case.max_total_s:
        return f"whole answer expected within {case.max_total_s:g} s, took {outcome.total_s:.3f} s"
    if case.text is not None:
        return case.text.mismatch(outcome.text)
    return None

