"""Time from a SIGKILLed python-backend stub to HEALTHY again, with the test suite's scaled-down
probe settings (interval 0.5 s, failure threshold 2, timeout 1.5 s, unload_timeout 2 s).

    .venv/bin/python bench/stub_kill_scaled.py --repeats 5

Runs the production app (create_app) in-process against a real Triton from nvidia-pytriton; each
repeat uses a fresh copy of tests/models/faulty. Prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.devtools.tritonserver import LocalTriton
from sidecar.logs import configure_logging
from sidecar.states import ModelState
from tests.harness import EXAMPLES, FreshModel, sidecar_config, start_sidecar, stop_sidecar, wait_for


async def one_fault(triton: LocalTriton, scratch: Path) -> dict[str, float]:
    model = FreshModel.create(triton, scratch)
    sidecar = await start_sidecar(sidecar_config(triton, models=[model.name], golden_dir=model.golden_dir))
    try:
        await wait_for(lambda: sidecar.state(model.name) is ModelState.HEALTHY, 30)
        killed = time.monotonic()
        model.kill_stub()
        unhealthy = await wait_for(lambda: sidecar.first_transition_to(model.name, ModelState.UNHEALTHY), 30)
        healed = await wait_for(lambda: sidecar.first_transition_to(model.name, ModelState.HEALTHY, after=killed), 60)
        return {"detect_s": unhealthy.at - killed, "recover_s": healed.at - killed,
                "heal_s": healed.at - unhealthy.at}
    finally:
        await stop_sidecar(sidecar)
        model.remove()


async def main(repeats: int) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="stub-kill-"))
    shutil.copytree(EXAMPLES, scratch / "repo")
    triton = LocalTriton(model_repository=scratch / "repo", models=["credit_risk"], workdir=scratch / "work")
    triton.start()
    try:
        runs = [await one_fault(triton, scratch) for _ in range(repeats)]
    finally:
        triton.stop(grace_s=3)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {key: {"median": round(statistics.median(r[key] for r in runs), 2),
                     "min": round(min(r[key] for r in runs), 2), "max": round(max(r[key] for r in runs), 2)}
               for key in runs[0]}
    print(json.dumps({"repeats": repeats, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    configure_logging(format="json", level="warning", stream=sys.stderr)
    asyncio.run(main(parser.parse_args().repeats))
