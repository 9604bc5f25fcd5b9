"""PSI noise by window size (docs/drift.md): what max PSI reads when nothing drifted, and what one
feature shifted by two standard deviations reads, for the sidecar's own windows and bins.

    .venv/bin/python -m bench.psi_noise [--seeds 5]

Reference: 5,000 standard-normal rows of 128 features, 10 quantile bins (record-reference's default).
Live: a window of N new rows drawn the same way (no drift), and the same rows with feature 7 + 2.
Per window size, the median over `--seeds` draws of: the mean PSI over features, the max over the
128 features (what TritonSidecarDataDrift looks at), and the shifted feature's PSI. No server: the
data plane's windows through sidecar.serving.drift.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from sidecar.config import SidecarConfig
from sidecar.serving.drift import DriftMonitor, Reference, parse_reference, reference_from_values

FEATURES = 128
REFERENCE_ROWS = 5000
WINDOWS = (100, 250, 500, 1000, 2000)
SHIFTED = 7


def psi_of(reference: Reference, live: np.ndarray) -> np.ndarray:
    """The PSI per feature of a window of exactly `live`'s rows (the sidecar's windows, in the data plane)."""
    monitor = DriftMonitor(replace(SidecarConfig().drift, window=len(live)), {("m", ""): reference})
    monitor.observe("m", "1", [("x", "FP64", live.shape, live)], [], batched=True)
    (window,) = monitor.windows_now("m")
    return window.inputs["x"].psi()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.psi_noise", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    print("| window (rows) | mean feature PSI, no drift | max over 128 features, no drift | one feature shifted 2σ |")
    print("| --- | --- | --- | --- |")
    for size in WINDOWS:
        means, maxes, shifted = [], [], []
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            doc = reference_from_values("m", "", {"x": ("FP64", rng.standard_normal((REFERENCE_ROWS, FEATURES)))}, {})
            reference = parse_reference(doc, Path("m.json"))
            live = rng.standard_normal((size, FEATURES))
            quiet = psi_of(reference, live)
            live[:, SHIFTED] += 2.0
            means.append(float(quiet.mean()))
            maxes.append(float(quiet.max()))
            shifted.append(float(psi_of(reference, live)[SHIFTED]))
        print(f"| {size:,} | {statistics.median(means):.3f} | {statistics.median(maxes):.3f} | "
              f"{statistics.median(shifted):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
