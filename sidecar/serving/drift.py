"""Live data and prediction drift: each model's inputs and outputs binned against a reference, in the
request path, at a bounded cost; PSI and missing-value ratios computed when someone asks (a scrape,
/status), never per request.

Why it looks the way it does:
- A reference (`Reference`, one JSON file per model, written by `triton-sidecar record-reference`)
  holds, per input feature and per output element, quantile bin edges, the reference's count in each
  bin, and its share of missing values. Quantile edges put about the same share of the reference in
  every bin, which is what makes PSI sensitive where the data actually lies.
- Per request the work is the data plane's (sidecar._dataplane.DriftWindows,
  dataplane/src/serving/drift.rs): each value binned against its feature's edges, and the row's
  cells overwrite the oldest row of a ring of `window` rows. The fronts' lanes count the answers they
  serve there without Python; the Python chain hands its decoded tensors to the same windows
  (`DriftMonitor.observe`). The count table is built from the ring when PSI is asked for (a scrape,
  /status), not kept up to date per request.
- Missing values (the configured sentinels per input; NaN where validation lets it through) go to an
  extra cell per feature: they count for the missing ratio and not for the distribution.
- Models without a reference cost one dict lookup per request and nothing else.
- Nothing here writes model state: a drifted model is reported (metrics, /status) and still served,
  because no reload can fix a world that changed (issue 22).

Pure logic, numpy and the data plane's windows: no aiohttp, no grpc (import-linter contract).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar._dataplane import DriftWindows, Recording
from sidecar.config import DriftSection
from sidecar.protocol.answers import BINARY_DTYPES
from sidecar.protocol.datatypes import FLOAT_DATATYPES

# numpy only where a function needs it (imported there): an idle sidecar never loads it (issue 30).
if TYPE_CHECKING:
    import numpy as np

#: Reference file format this code writes and reads.
REFERENCE_FORMAT = 1


#: Bins per feature in a recorded reference: 10 quantile bins is the usual PSI practice (deciles);
#: more bins make a window of 1,000 rows noisier (docs/drift.md), fewer hide shifts inside a bin.
DEFAULT_BINS = 10


#: Floor on a bin's share before the logarithm of PSI: an empty bin would make PSI infinite. 1e-4
#: is the usual choice; it caps one empty bin's contribution at about 0.1 * ln(0.1 / 1e-4) = 0.7.
PSI_FLOOR = 1e-4


#: Datatypes whose values can be binned (BYTES and BOOL cannot; BF16 has no numpy dtype).
BINNABLE = frozenset(BINARY_DTYPES)


class ReferenceFileError(ValueError):
    """A reference file that cannot be used; the message names the file and the key."""


#: A decoded tensor: (name, datatype, shape, values). Values are a numpy array, or bytes / a memoryview
#: of little-endian binary data (viewed in place only when the tensor is measured).
Tensor = tuple[str, str, Sequence[int], Any]


# -- the reference --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorReference:
    """One tensor's reference: per feature (an element of a row), bin edges and counts."""

    name: str
    datatype: str
    #: Features per row (elements of one batch item).
    features: int
    #: Label per feature in metrics: the given names, else the index.
    feature_names: tuple[str, ...]
    #: (features, bins - 1) interior edges, padded with +inf where a feature has fewer distinct
    #: quantiles (a discrete feature); value v is in bin = number of edges <= v.
    edges: np.ndarray
    #: (features, bins) reference counts per bin (present values only).
    counts: np.ndarray
    #: (features,) share of the reference's values that were missing.
    missing: np.ndarray

    @property
    def bins(self) -> int:
        return int(self.edges.shape[1]) + 1

    @property
    def expected(self) -> np.ndarray:
        """(features, bins) reference proportions per feature, floored for PSI."""
        import numpy as np

        totals = self.counts.sum(axis=1, keepdims=True)
        return np.maximum(self.counts / np.maximum(totals, 1), PSI_FLOOR)


@dataclass(frozen=True)
class Reference:
    model: str
    #: The model version it was recorded on; "" = any version.
    version: str
    rows: int
    inputs: Mapping[str, TensorReference]
    outputs: Mapping[str, TensorReference]
    path: Path | None = None


def reference_from_values(model: str, version: str, inputs: Mapping[str, tuple[str, np.ndarray]],
                          outputs: Mapping[str, tuple[str, np.ndarray]], *, bins: int = DEFAULT_BINS,
                          sentinels: Mapping[str, Sequence[float]] | None = None) -> dict[str, Any]:
    """The reference document of recorded rows. `inputs`/`outputs`: name -> (datatype, (rows, features)
    array); `sentinels`: input name -> values that mean "missing"."""
    import numpy as np

    sentinels = sentinels or {}
    rows = {name: len(values) for name, (_, values) in {**inputs, **outputs}.items()}
    if len(set(rows.values())) > 1:
        raise ValueError(f"tensors hold different numbers of rows: {rows}")
    doc: dict[str, Any] = {"format": REFERENCE_FORMAT, "model": model, "version": version or None,
                           "rows": next(iter(rows.values()), 0), "bins": bins,
                           "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "inputs": {}, "outputs": {}}
    for kind, tensors in (("inputs", inputs), ("outputs", outputs)):
        for name, (datatype, values) in tensors.items():
            if datatype not in BINNABLE:
                continue
            doc[kind][name] = _tensor_reference_doc(datatype, np.asarray(values, dtype=np.float64),
                                                    bins, sentinels.get(name, ()))
    return doc


def _tensor_reference_doc(datatype: str, values: np.ndarray, bins: int, sentinels: Sequence[float]) -> dict[str, Any]:
    import numpy as np

    values = values.reshape(len(values), -1)
    edges, counts, missing = [], [], []
    for column in values.T:
        absent = np.isin(column, sentinels) | np.isnan(column)
        present = column[~absent]
        cuts = np.unique(np.quantile(present, np.linspace(0, 1, bins + 1)[1:-1])) if present.size else np.array([])
        # Edges equal to the minimum would leave the first bin empty in the reference itself.
        cuts = cuts[cuts > present.min()] if present.size else cuts
        edges.append([float(c) for c in cuts])
        counts.append([int(c) for c in np.bincount(np.searchsorted(cuts, present, side="right"),
                                                   minlength=len(cuts) + 1)])
        missing.append(float(absent.mean()) if column.size else 0.0)
    return {"datatype": datatype, "features": int(values.shape[1]), "edges": edges, "counts": counts,
            "missing": missing}


def load_reference(path: Path) -> Reference:
    """The reference in `path`; ReferenceFileError names the file and the key when it cannot be used."""
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ReferenceFileError(f"{path}: cannot read the reference file: {e.strerror}") from e
    except ValueError as e:
        raise ReferenceFileError(f"{path}: not valid JSON: {e}") from e
    return parse_reference(doc, path)


def parse_reference(doc: Any, path: Path) -> Reference:
    def fail(key: str, message: str) -> ReferenceFileError:
        return ReferenceFileError(f"{path}: key {key!r}: {message}")

    if not isinstance(doc, dict):
        raise ReferenceFileError(f"{path}: the top level must be an object (model, inputs, outputs)")
    if doc.get("format") != REFERENCE_FORMAT:
        raise fail("format", f"must be {REFERENCE_FORMAT}, got {doc.get('format')!r}")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise fail("model", "must be the model's name")
    version = doc.get("version")
    if version is not None and not isinstance(version, str):
        raise fail("version", "must be a string (a model version) or null (any version)")
    rows = doc.get("rows")
    if not isinstance(rows, int) or rows < 1:
        raise fail("rows", f"must be a positive integer, got {rows!r}")
    tensors: dict[str, dict[str, TensorReference]] = {}
    for kind in ("inputs", "outputs"):
        section = doc.get(kind, {})
        if not isinstance(section, dict):
            raise fail(kind, "must be an object of tensor name -> reference")
        tensors[kind] = {name: _parse_tensor(name, t, f"{kind}.{name}", fail) for name, t in section.items()}
    if not tensors["inputs"] and not tensors["outputs"]:
        raise fail("inputs", "neither inputs nor outputs hold a reference: nothing to measure")
    return Reference(model, version or "", rows, tensors["inputs"], tensors["outputs"], path)


def _parse_tensor(name: str, doc: Any, key: str, fail: Callable[[str, str], ReferenceFileError]) -> TensorReference:
    import numpy as np

    if not isinstance(doc, dict):
        raise fail(key, "must be an object with datatype, features, edges, counts, missing")
    datatype = doc.get("datatype")
    if datatype not in BINNABLE:
        raise fail(f"{key}.datatype", f"must be a numeric v2 datatype, got {datatype!r}")
    features = doc.get("features")
    if not isinstance(features, int) or features < 1:
        raise fail(f"{key}.features", f"must be a positive integer, got {features!r}")
    lists = {}
    for field_name in ("edges", "counts"):
        value = doc.get(field_name)
        if not isinstance(value, list) or len(value) != features or not all(isinstance(v, list) for v in value):
            raise fail(f"{key}.{field_name}", f"must be a list of {features} lists (one per feature)")
        lists[field_name] = value
    width = max(len(e) for e in lists["edges"]) + 1
    edges = np.full((features, width - 1), np.inf)
    counts = np.zeros((features, width))
    for i, (cuts, count) in enumerate(zip(lists["edges"], lists["counts"], strict=True)):
        if not all(isinstance(c, (int, float)) and math.isfinite(c) for c in cuts) or cuts != sorted(set(cuts)):
            raise fail(f"{key}.edges.{i}", "must be finite numbers in strictly increasing order")
        if len(count) != len(cuts) + 1 or not all(isinstance(c, int) and c >= 0 for c in count) or not sum(count):
            raise fail(f"{key}.counts.{i}", f"must be {len(cuts) + 1} non-negative integers (one per bin), "
                                            "not all zero")
        edges[i, :len(cuts)] = cuts
        counts[i, :len(count)] = count
    missing = doc.get("missing", [0.0] * features)
    if (not isinstance(missing, list) or len(missing) != features
            or not all(isinstance(m, (int, float)) and 0 <= m <= 1 for m in missing)):
        raise fail(f"{key}.missing", f"must be {features} shares between 0 and 1")
    names = doc.get("feature_names")
    if names is None:
        names = [str(i) for i in range(features)]
    elif not isinstance(names, list) or len(names) != features or not all(isinstance(n, str) and n for n in names):
        raise fail(f"{key}.feature_names", f"must be {features} non-empty strings")
    return TensorReference(name, datatype, features, tuple(names), edges, counts, np.asarray(missing, float))


def reference_files(directory: Path) -> list[Path]:
    """The reference files in `directory`: `<model>.json`, or `<model>@<version>.json` for one version."""
    try:
        return sorted(p for p in directory.glob("*.json") if p.is_file() and not p.name.startswith("."))
    except OSError:
        return []


def reference_key(path: Path) -> tuple[str, str]:
    """(model, version) a file name stands for: `credit_risk.json` any version, `credit_risk@2.json` version 2."""
    model, _, version = path.stem.partition("@")
    return model, version


def load_reference_dir(directory: Path) -> dict[tuple[str, str], Reference]:
    """Every reference in `directory` by (model, version); the first broken file raises ReferenceFileError."""
    found = {}
    for path in reference_files(directory):
        found[reference_key(path)] = checked_reference(path)
    return found


def checked_reference(path: Path) -> Reference:
    """The reference in `path`, which must name the model (and version) its file name says."""
    reference = load_reference(path)
    model, version = reference_key(path)
    if reference.model != model:
        raise ReferenceFileError(f"{path}: key 'model': the file is named for model {model!r} but holds "
                                 f"{reference.model!r}")
    if version and reference.version not in ("", version):
        raise ReferenceFileError(f"{path}: key 'version': the file is named for version {version} but holds "
                             f"{reference.version}")
    return reference


# -- the live window --------------------------------------------------------------------------------------
# The windows themselves (binning, the ring of the last drift.window rows) are the data plane's:
# sidecar._dataplane.DriftWindows (dataplane/src/serving/drift.rs), fed by the fronts' lanes and by
# `DriftMonitor.observe` for what the Python chain serves. Python reads their count tables when
# someone asks (a scrape, /status) and computes PSI and missing ratios from them here.


@dataclass(frozen=True)
class TensorCounts:
    """What one tensor's window holds now."""

    reference: TensorReference
    #: drift.window: the rows a full window holds.
    window: int
    rows: int
    #: (features, bins + 1) counts of the window's rows; the last column counts missing values.
    counts: np.ndarray
    #: Every row ever seen, per bin (a one-feature tensor's cumulative histogram), and their sum.
    total: np.ndarray
    sum: float

    def table(self) -> np.ndarray:
        return self.counts

    def psi(self) -> np.ndarray:
        """(features,) population stability index of the window against the reference."""
        import numpy as np

        counts = self.counts[:, :-1]
        actual = np.maximum(counts / np.maximum(counts.sum(axis=1, keepdims=True), 1), PSI_FLOOR)
        expected = self.reference.expected
        return ((actual - expected) * np.log(actual / expected)).sum(axis=1)  # type: ignore[no-any-return]

    def missing_ratio(self) -> float:
        """Share of the window's values (all features) that were missing."""
        if not self.rows:
            return 0.0
        return float(self.counts[:, -1].sum() / (self.rows * self.reference.features))


@dataclass
class ModelWindow:
    """One model version's windows, one per measured tensor, as read now."""

    model: str
    version: str
    reference: Reference
    inputs: dict[str, TensorCounts]
    outputs: dict[str, TensorCounts]

    @property
    def rows(self) -> int:
        return max((tw.rows for _, tw in self.tensors()), default=0)

    def tensors(self) -> Iterator[tuple[str, TensorCounts]]:
        yield from self.inputs.items()
        yield from self.outputs.items()


@dataclass(frozen=True)
class TensorPsi:
    tensor: str
    #: (feature label, PSI), most drifted first, at most drift.max_features.
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class DriftReading:
    """What the window of one model version says now."""

    model: str
    version: str
    rows: int
    #: True once the window is full: a PSI over fewer rows is mostly noise (docs/drift.md).
    measured: bool
    max_psi: float
    #: (tensor, feature) of max_psi.
    worst: tuple[str, str]
    tensors: tuple[TensorPsi, ...]
    missing: Mapping[str, float] = field(default_factory=dict)


class DriftMonitor:
    """Live drift of every model that has a reference; read by /metrics (`collect`) and /status."""

    def __init__(self, settings: DriftSection, references: Mapping[tuple[str, str], Reference], *,
                 count_nan: bool = False, rng: Callable[[], float] = random.random) -> None:
        self.settings = settings
        self.count_nan = count_nan
        self._rng = rng
        self._references: dict[tuple[str, str], Reference] = dict(references)
        self._models = {model for model, _ in self._references}
        #: The windows, in the data plane (the HTTP front's lanes count in these too: HttpFront's
        #: `drift` argument).
        self.windows = DriftWindows()
        self._publish()
        #: Watchers of live recording (record-reference --live): model -> recorders.
        self.recorders: dict[str, list[LiveRecorder]] = {}
        #: Why the last reload of the reference files was refused (file and key); None once one loads.
        self.refused: str | None = None

    def add_recorder(self, recorder: LiveRecorder) -> None:
        recorder.native = self.windows.record(recorder.model, recorder.rows, recorder.version)
        self.recorders.setdefault(recorder.model, []).append(recorder)

    def remove_recorder(self, recorder: LiveRecorder) -> None:
        if recorder.native is not None:
            self.windows.stop(recorder.native)
        recorders = self.recorders.get(recorder.model, [])
        if recorder in recorders:
            recorders.remove(recorder)
        if not recorders:
            self.recorders.pop(recorder.model, None)

    def recorded(self, model: str) -> None:
        """A recording of `model` may have its rows (a lane's event, or the Python chain's answer):
        tell the waiters of those that do."""
        for recorder in self.recorders.get(model, ()):
            if recorder.done:
                recorder.on_done()

    # -- the request path -------------------------------------------------------------------------------

    def wants(self, model: str) -> bool:
        """Measure this request? One set lookup for models without a reference or a recording."""
        if model not in self._models and model not in self.recorders:
            return False
        rate = self.settings.sample_rate
        return rate >= 1.0 or self._rng() < rate

    def observe(self, model: str, version: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor], *,
                batched: bool) -> None:
        """Count one answered request: its decoded inputs and outputs, `version` the one that answered;
        `batched`: the first dimension of every tensor is the batch (the model's max_batch_size > 0)."""
        if model in self._models or model in self.recorders:
            if self.windows.observe(model, version, batched, _floats(inputs), _floats(outputs)):
                self.recorded(model)

    def _publish(self) -> None:
        """Hand the data plane's windows what they bin against now (a start, a reload, new settings)."""
        published = []
        for (model, version), reference in sorted(self._references.items()):
            sentinels = self.settings.missing_sentinels.get(model, {})
            published.append((model, version,
                              [self._bins(t, sentinels.get(n, ())) for n, t in reference.inputs.items()],
                              [self._bins(t, ()) for t in reference.outputs.values()]))
        self.windows.set(published, self.settings.window, self.settings.sample_rate)

    def _bins(self, tensor: TensorReference,
              sentinels: Sequence[float]) -> tuple[str, int, int, bytes, list[float], bool]:
        import numpy as np

        edges = np.ascontiguousarray(tensor.edges, dtype="<f8").tobytes()
        count_nan = self.count_nan and tensor.datatype in FLOAT_DATATYPES
        return tensor.name, tensor.features, tensor.bins, edges, [float(v) for v in sentinels], count_nan

    def windows_now(self, model: str | None = None) -> list[ModelWindow]:
        """Every measured model version's windows as they hold now, sorted by (model, version)."""
        found = []
        for model_, version, key, inputs, outputs in self.windows.windows(model):
            reference = self._references.get((model_, key))
            if reference is None:
                continue  # defensive: `_publish` hands the data plane exactly these references
            window = self.settings.window
            found.append(ModelWindow(model_, version, reference, _counted(inputs, reference.inputs, window),
                                     _counted(outputs, reference.outputs, window)))
        return found

    # -- references ---------------------------------------------------------------------------------------

    def has_reference(self, model: str) -> bool:
        return model in self._models

    def reference_for(self, model: str) -> list[Reference]:
        return [r for (m, _), r in sorted(self._references.items()) if m == model]

    def replace_references(self, references: Mapping[tuple[str, str], Reference]) -> None:
        """A reload: windows of a changed or removed reference start again (their bins changed)."""
        self._references = dict(references)
        self._models = {model for model, _ in self._references}
        self._publish()

    def reconfigure(self, settings: DriftSection, *, count_nan: bool) -> None:
        # A new window size, sentinel set or NaN rule counts again from empty (the data plane
        # compares what it is handed with what it had).
        self.settings = settings
        self.count_nan = count_nan
        self._publish()

    # -- readings -----------------------------------------------------------------------------------------

    def readings(self, model: str | None = None) -> list[DriftReading]:
        return [_reading(w, self.settings.max_features) for w in self.windows_now(model)]

    def status(self, model: str) -> dict[str, Any]:
        """The model's drift for /status; `degraded` only with drift.degrade_above_psi, and never in
        the model's state (the health supervisor owns it): the model is still served."""
        if not self.has_reference(model):
            return {"measured": False, "reason": f"no reference file for {model} in {self.settings.reference_dir}"}
        threshold = self.settings.degrade_above_psi
        versions = {}
        degraded_by: list[str] = []
        for reading in self.readings(model):
            tensor, feature = reading.worst
            versions[reading.version or "(unversioned)"] = {
                "rows_in_window": reading.rows, "window_full": reading.measured,
                "max_psi": round(reading.max_psi, 4) if reading.measured else None,
                "most_drifted": {"tensor": tensor, "feature": feature} if reading.measured and tensor else None,
                "missing_ratio": {k: round(v, 4) for k, v in reading.missing.items()},
            }
            if threshold is not None and reading.measured and reading.max_psi > threshold:
                label = f" version {reading.version}" if reading.version else ""
                degraded_by.append(f"model {model}{label}: PSI {reading.max_psi:.2f} > {threshold:g} "
                                   f"(drift.degrade_above_psi) in {tensor} feature {feature}")
        return {"measured": True, "references": [str(r.path) for r in self.reference_for(model)],
                "state": "DEGRADED" if degraded_by else "STABLE", "degraded": bool(degraded_by),
                "cause": "; ".join(degraded_by) or None, "versions": versions,
                "reload_refused": self.refused}

    def collector(self) -> Collector:
        return _DriftCollector(self)


def _counted(tensors: Sequence[tuple[str, int, bytes, bytes, float]], of: Mapping[str, TensorReference],
             window: int) -> dict[str, TensorCounts]:
    """The data plane's counts of each tensor (DriftWindows.windows) as arrays, with its reference."""
    import numpy as np

    out = {}
    for name, rows, table, total, total_sum in tensors:
        t = of[name]
        counts = np.frombuffer(table, dtype="<u8").astype(np.int64).reshape(t.features, t.bins + 1)
        out[name] = TensorCounts(t, window, rows, counts, np.frombuffer(total, dtype="<u8").astype(np.int64),
                                 total_sum)
    return out


def _floats(tensors: Sequence[Tensor]) -> list[tuple[str, str, list[int], bytes]]:
    """The binnable tensors, their values as float64 little-endian bytes, for the data plane."""
    import numpy as np

    out = []
    for name, datatype, shape, values in tensors:
        if datatype not in BINNABLE:
            continue
        if not isinstance(values, np.ndarray):
            values = np.frombuffer(values, dtype=BINARY_DTYPES[datatype])
        out.append((name, datatype, [int(d) for d in shape], np.ascontiguousarray(values, dtype="<f8").tobytes()))
    return out


def _reading(window: ModelWindow, max_features: int) -> DriftReading:
    import numpy as np

    tensors = []
    max_psi, worst = 0.0, ("", "")
    for name, tw in window.tensors():
        if not tw.rows:
            continue
        psi = tw.psi()
        order = np.argsort(psi)[::-1][:max_features]
        labels = tw.reference.feature_names
        top = tuple((labels[i], float(psi[i])) for i in order)
        tensors.append(TensorPsi(name, top))
        if top and top[0][1] > max_psi:
            max_psi, worst = top[0][1], (name, top[0][0])
    missing = {name: tw.missing_ratio() for name, tw in window.inputs.items()}
    full = window.rows >= next(iter(tw.window for _, tw in window.tensors()), 0) > 0
    return DriftReading(window.model, window.version, window.rows, full, max_psi, worst, tuple(tensors), missing)


class _DriftCollector(Collector):
    """The drift metrics, computed at scrape time from the windows (none per request)."""

    def __init__(self, monitor: DriftMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        import numpy as np

        psi = GaugeMetricFamily("triton_sidecar_drift_psi", "Population stability index of the sliding window "
                                "against the model's reference, per tensor and feature (the most drifted "
                                "drift.max_features per tensor). 0.1-0.25: a shift worth a look; above 0.25: "
                                "a significant one.", labels=["model", "version", "tensor", "feature"])
        max_psi = GaugeMetricFamily("triton_sidecar_drift_max_psi", "Largest PSI of any measured feature or "
                                    "output of the model version.", labels=["model", "version"])
        missing = GaugeMetricFamily("triton_sidecar_feature_missing_ratio", "Share of the window's values of the "
                                    "input that were missing (drift.missing_sentinels).",
                                    labels=["model", "version", "input"])
        histogram = HistogramMetricFamily("triton_sidecar_output_value", "Values of each scalar output, in "
                                          "the reference's bins.", labels=["model", "version", "output"])
        monitor = self.monitor
        for window in monitor.windows_now():
            model, version = window.model, window.version
            reading = _reading(window, monitor.settings.max_features)
            if reading.measured:
                for tensor in reading.tensors:
                    for feature, value in tensor.top:
                        psi.add_metric([model, version, tensor.tensor, feature], value)
                max_psi.add_metric([model, version], reading.max_psi)
            for name, ratio in reading.missing.items():
                missing.add_metric([model, version, name], ratio)
            for name, tw in window.outputs.items():
                if tw.reference.features != 1:
                    continue
                edges = [e for e in tw.reference.edges[0] if math.isfinite(e)]
                cumulative = np.cumsum(tw.total)
                buckets = [(_le(e), float(c)) for e, c in zip(edges, cumulative, strict=False)]
                buckets.append(("+Inf", float(cumulative[-1])))
                histogram.add_metric([model, version, name], buckets, tw.sum)
        yield from (psi, max_psi, missing, histogram)

    def describe(self) -> Iterator[Any]:
        return iter(())  # the families' labels depend on the references: no fixed description


def _le(edge: float) -> str:
    # Bins count v >= edge in the next bin, Prometheus' `le` is v <= bound: the bound just below the
    # edge keeps the two in step for real-valued data.
    import numpy as np

    return repr(float(np.nextafter(edge, -np.inf)))


# -- live recording (record-reference --live) -----------------------------------------------------------


class LiveRecorder:
    """The raw values of the next `rows` answered rows of one model (of one answered version when
    `version` is given), for a reference. Recorded by the data plane (sidecar._dataplane.Recording,
    fed by the fronts' lanes and the Python chain alike), held in memory only, and only while someone
    records (never logged); `DriftMonitor.add_recorder` starts it."""

    def __init__(self, model: str, rows: int, version: str = "") -> None:
        self.model = model
        self.rows = rows
        #: "" records every version's answers; else only this version's (a `<model>@<version>.json`
        #: reference must not hold another version's outputs).
        self.version = version
        self.native: Recording | None = None
        #: Called once the rows are in (from the event loop: a lane's recording says so as an event).
        self.on_done: Callable[[], None] = lambda: None

    @property
    def seen(self) -> int:
        return self.native.seen if self.native is not None else 0

    @property
    def done(self) -> bool:
        return self.native is not None and self.native.done

    def reference(self, *, bins: int, sentinels: Mapping[str, Sequence[float]]) -> dict[str, Any]:
        """The reference document of what was recorded."""
        import numpy as np

        assert self.native is not None, "a recorder is started by DriftMonitor.add_recorder"
        inputs, outputs = self.native.take()

        def stacked(tensors: Sequence[tuple[str, str, int, bytes]]) -> dict[str, tuple[str, np.ndarray]]:
            return {name: (datatype, np.frombuffer(values, dtype="<f8").reshape(-1, features))
                    for name, datatype, features, values in tensors}

        return reference_from_values(self.model, self.version, stacked(inputs), stacked(outputs),
                                     bins=bins, sentinels=sentinels)
