"""`triton-sidecar demo`: a real Triton with the example models and the sidecar in front of it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from sidecar.cli.arguments import EXIT_OK, REPO_ROOT, UsageError
from sidecar.cli.run import run_on_loop, serve
from sidecar.config import SidecarConfig, load_config
from sidecar.golden.cases import load_golden_dir
from sidecar.logs import configure_logging

#: Triton's own bound on its exit (--exit-timeout-secs; 30 s by default). By the time the demo stops
#: Triton the sidecar has drained, so nothing is in flight; what Triton would wait for is a model
#: whose python stub was killed (the demo's own suggestion): that instance never finishes unloading.
TRITON_EXIT_TIMEOUT_S = 1
#: Then SIGKILL: Ctrl-C ends the demo within about this long plus the sidecar's drain_s.
TRITON_STOP_GRACE_S = 2.0


def cmd_demo(args: argparse.Namespace) -> int:
    repository = REPO_ROOT / "examples" / "model_repository"
    golden_dir = REPO_ROOT / "golden_requests"
    config_path = REPO_ROOT / "examples" / "sidecar.demo.yaml"
    if not repository.is_dir():
        raise UsageError(f"{repository}: the example model repository is missing (run from a source checkout)")
    base = load_config(config_path)
    # Triton's log, its python backend copy (2.8 MB) and its stubs' files; removed on every exit.
    workdir = Path(tempfile.mkdtemp(prefix="triton-sidecar-demo-"))
    try:
        return _run_demo(args, base, repository, golden_dir, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_demo(args: argparse.Namespace, base: SidecarConfig, repository: Path, golden_dir: Path,
              workdir: Path) -> int:
    from sidecar.devtools.tritonserver import LocalTriton, TritonServerError, stub_pids

    triton = LocalTriton(model_repository=repository, models=["credit_risk", "image_classifier", "text_echo"],
                         workdir=workdir, exit_timeout_s=TRITON_EXIT_TIMEOUT_S)
    print(f"Starting Triton (log: {triton.log_path}, removed when the demo ends) ...", flush=True)
    try:
        triton.start()
    except TritonServerError as e:
        raise UsageError(str(e)) from e
    config = replace(
        base,
        triton=replace(base.triton, url=triton.url, metrics_url=triton.metrics_url,
                       grpc_url=f"127.0.0.1:{triton.ports.grpc}"),
        listen=replace(base.listen, host="127.0.0.1", port=args.port, grpc_port=args.grpc_port),
        golden_dir=golden_dir,
    )
    url = f"http://127.0.0.1:{args.port}"
    grpc_line = (f"\n  gRPC     127.0.0.1:{args.grpc_port} (KServe v2 and grpc.health.v1), e.g. with tritonclient.grpc"
                 if args.grpc_port else "")
    stub = ", ".join(str(p) for p in stub_pids("credit_risk", parent=triton.pid)) or "?"
    print(f"""
Triton {triton.url} (pid {triton.pid}) is running the example models; the sidecar listens on {url}
  status   curl -s {url}/status | python3 -m json.tool
  liveness curl -i {url}/healthz
  ready    curl -i {url}/readyz
  metrics  curl -s {url}/metrics | grep triton_sidecar_model_state
  infer    curl -s {url}/v2/models/credit_risk/infer -H 'Content-Type: application/json' \\
             -d @examples/requests/credit_risk.json
  stream   curl -sN {url}/v2/models/text_echo/generate_stream -H 'Content-Type: application/json' \\
             -d '{{"text_input": "one word per event", "max_tokens": 8}}'{grpc_line}

Break a model and watch it heal (Triton itself keeps saying ready):
  kill -9 {stub}     # the credit_risk python stub; or: pkill -9 -f credit_risk/1/model.py
  watch -n 0.5 "curl -s {url}/readyz"
Ctrl-C stops both.
""", flush=True)
    configure_logging(format="console", level=config.logging.level)
    golden = load_golden_dir(config.golden_dir)

    async def run_demo() -> None:
        stop = asyncio.Event()
        if args.duration:
            asyncio.get_running_loop().call_later(args.duration, stop.set)
        await serve(config, golden, stop=stop)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            run_on_loop(run_demo(), config)
    finally:
        triton.stop(TRITON_STOP_GRACE_S, on_slow_stop=lambda text: print(text, flush=True))
        print(f"Triton stopped; {workdir} removed.", flush=True)
    return EXIT_OK

