"""Model repositories and golden directories the benchmarks build in temp dirs."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "model_repository"
GOLDEN = REPO / "golden_requests"
BENCH_MODELS = REPO / "bench" / "models"
FAULTY_TEMPLATE = REPO / "tests" / "models" / "faulty"

#: The example credit_risk model's weights (same seed as its model.py), for checking answers.
_CREDIT_RNG_SEED = 20261202


def credit_risk_scores(features: np.ndarray) -> np.ndarray:
    """What credit_risk (and its clones, credit_risk_2ms, the faulty template) answers for `features`."""
    rng = np.random.default_rng(_CREDIT_RNG_SEED)
    w = (rng.standard_normal(128) / np.sqrt(128)).astype(np.float32)
    z = features.astype(np.float32) @ w + np.float32(-0.25)
    return (1.0 / (1.0 + np.exp(-z))).astype(np.float32).reshape(-1, 1)


def copy_model(source: Path, repository: Path, name: str) -> Path:
    """`source` copied into `repository` as model `name` (config.pbtxt renamed accordingly)."""
    target = repository / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "fault"))
    config = target / "config.pbtxt"
    text = config.read_text()
    old = next(line for line in text.splitlines() if line.startswith("name:"))
    config.write_text(text.replace(old, f'name: "{name}"', 1))
    return target


def copy_golden(source_model: str, golden_dir: Path, name: str) -> None:
    """The golden cases of `source_model` (golden_requests/) for a clone called `name`."""
    target = golden_dir / name
    target.mkdir(parents=True, exist_ok=True)
    for case in (GOLDEN / source_model).iterdir():
        if case.suffix in (".json", ".yaml", ".yml"):
            shutil.copy(case, target / case.name)


@dataclass(frozen=True)
class BuiltRepository:
    repository: Path
    golden_dir: Path
    models: list[str]


def credit_clones(root: Path, names: list[str], *, sources: dict[str, Path] | None = None) -> BuiltRepository:
    """Clones of credit_risk (or of `sources[name]`, e.g. credit_risk_2ms) with credit_risk's golden cases."""
    repository, golden_dir = root / "model_repository", root / "golden"
    repository.mkdir(parents=True, exist_ok=True)
    golden_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        copy_model((sources or {}).get(name, EXAMPLES / "credit_risk"), repository, name)
        copy_golden("credit_risk", golden_dir, name)
    return BuiltRepository(repository, golden_dir, list(names))


# ---- weighted models (bench/recovery.py) ------------------------------------------------------


def derive_weights(raw: bytes) -> np.ndarray:
    """Same as derive_weights in bench/models/weighted/1/model.py."""
    table = np.frombuffer(raw, dtype="<f4").reshape(-1, 128)
    return (table.sum(axis=0, dtype=np.float64) / np.sqrt(table.shape[0] * 128)).astype(np.float32)


def weighted_scores(w: np.ndarray, features: np.ndarray) -> np.ndarray:
    z = features.astype(np.float32) @ w
    return (1.0 / (1.0 + np.exp(-z))).astype(np.float32).reshape(-1, 1)


#: The probe's and the bystander client's input for the weighted models.
WEIGHTED_PROBE_FEATURES = np.linspace(-1.0, 1.0, 128, dtype=np.float32).reshape(1, 128)


def weighted_models(root: Path, *, count: int, weights_mb: int) -> tuple[BuiltRepository, dict[str, np.ndarray]]:
    """`count` weighted models, each with its own random weights file of `weights_mb` MB and checksum,
    a golden case pinning its answer; returns the repository and each model's derived weights."""
    repository, golden_dir = root / "model_repository", root / "golden"
    repository.mkdir(parents=True, exist_ok=True)
    rows = max(1, weights_mb * 1024 * 1024 // (128 * 4))
    derived: dict[str, np.ndarray] = {}
    names = [f"weighted_{i}" for i in range(count)]
    for i, name in enumerate(names):
        target = copy_model(BENCH_MODELS / "weighted", repository, name)
        rng = np.random.default_rng(1000 + i)
        raw = rng.standard_normal((rows, 128), dtype=np.float32).astype("<f4").tobytes()
        (target / "1" / "weights.f32").write_bytes(raw)
        (target / "1" / "weights.sha256").write_text(hashlib.sha256(raw).hexdigest() + "\n")
        derived[name] = derive_weights(raw)
        del raw
        expected = weighted_scores(derived[name], WEIGHTED_PROBE_FEATURES)
        case = {
            "description": "A fixed ramp of features; the answer depends on every byte of the weights file.",
            "request": {"inputs": [{"name": "features", "shape": [1, 128], "datatype": "FP32",
                                    "data": WEIGHTED_PROBE_FEATURES.ravel().tolist()}]},
            "expect": {"status": 200, "outputs": {"scores": {
                "datatype": "FP32", "shape": [1, 1], "data": expected.ravel().tolist(),
                "atol": 1e-5, "rtol": 1e-4}}},
        }
        (golden_dir / name).mkdir(parents=True, exist_ok=True)
        (golden_dir / name / "normal.json").write_text(json.dumps(case))
    return BuiltRepository(repository, golden_dir, names), derived
