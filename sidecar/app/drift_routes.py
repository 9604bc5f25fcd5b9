"""POST /drift/{model}/record?rows=N[&version=V]: the drift reference of the next N rows the sidecar
answers for a model, of version V only when given (`triton-sidecar record-reference --live N
[--version V]`).

The raw values are held in memory only for the recording, never logged; the answer is the reference
(bin edges and counts), not the values.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from sidecar.fronts.appkeys import LIVE, SERVING, STATES
from sidecar.serving.drift import DEFAULT_BINS, LiveRecorder

#: Longest a recording may wait for traffic (s): a client that asks for more rows than arrive gets a
#: 504 naming how many came, not a connection held forever.
MAX_RECORD_S = 3600.0


async def record_reference(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    if request.app[STATES].get(model) is None:
        return web.json_response({"error": f"model {model} is not guarded by this sidecar"}, status=404)
    try:
        rows = int(request.query.get("rows", ""))
        bins = int(request.query.get("bins", str(DEFAULT_BINS)))
        timeout_s = float(request.query.get("timeout_s", "600"))
    except ValueError:
        return web.json_response({"error": "rows, bins and timeout_s must be numbers"}, status=400)
    if not 1 <= rows <= 1_000_000 or not 2 <= bins <= 100 or not 0 < timeout_s <= MAX_RECORD_S:
        return web.json_response({"error": f"rows must be 1..1000000, bins 2..100, timeout_s 0..{MAX_RECORD_S:g}"},
                                 status=400)
    version = request.query.get("version", "")
    if version and not version.isdigit():
        return web.json_response({"error": f"version must be a model version number, got {version!r}"}, status=400)
    monitor = request.app[SERVING].drift
    recorder = LiveRecorder(model, rows, version)
    done = asyncio.Event()
    recorder.on_done = done.set
    monitor.add_recorder(recorder)
    try:
        async with asyncio.timeout(timeout_s):
            await done.wait()
    except TimeoutError:
        return web.json_response({"error": f"only {recorder.seen} of {rows} rows of {model} were answered within "
                                           f"{timeout_s:g} s"}, status=504)
    finally:
        monitor.remove_recorder(recorder)
    sentinels = request.app[LIVE].config.drift.missing_sentinels.get(model, {})
    return web.json_response(recorder.reference(bins=bins, sentinels=sentinels))

