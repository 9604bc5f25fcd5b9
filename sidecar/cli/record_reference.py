"""`triton-sidecar record-reference`: the drift reference of a model, from a file of requests sent to
Triton, or from the next N requests a running sidecar answers.

The reference holds, per input feature and per output element, quantile bin edges, the counts in
each bin and the share of missing values (sidecar.serving.drift). It is written to
`<out>/<model>.json` (`<model>@<version>.json` with --version), which `run` reads from
drift.reference_dir and re-reads when it changes.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sidecar.cli.arguments import (
    DEFAULT_CALL_TIMEOUT_S,
    EXIT_FAILED,
    EXIT_OK,
    CommandError,
    positive_seconds,
    reporting_usage_errors,
)
from sidecar.config import ConfigError, SidecarConfig, load_config
from sidecar.protocol.answers import answer_tensors
from sidecar.serving.drift import DEFAULT_BINS, ReferenceFileError, parse_reference, reference_from_values

# numpy is imported inside the functions that use it: a running sidecar (gRPC off) loads none (issue 30).

#: Rows below which a reference is refused: with 10 bins, fewer than ~50 rows per bin make the
#: reference's own proportions noisy enough to show up as drift (docs/drift.md).
MIN_ROWS = 500


class _Failed(Exception):
    """Triton or the sidecar did not give what the reference needs: exit 1."""


def add_record_reference_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "record-reference",
        help="record a model's drift reference (input and output distributions)",
        description=(
            "Write <out>/<model>.json: per input feature and per output element, quantile bin edges,\n"
            "counts and the share of missing values (drift.missing_sentinels). --from sends each\n"
            "request of a JSON-lines file (one v2 body per line) to Triton and bins the requests and\n"
            "the answers; --live asks a running sidecar for the next N requests it answers.\n\n"
            "exit codes: 0 written; 1 Triton or the sidecar failed; 2 bad usage or a bad file"
        ),
        epilog=(
            "examples:\n"
            "  triton-sidecar record-reference --model credit_risk --from requests.jsonl --config sidecar.yaml\n"
            "  triton-sidecar record-reference --model credit_risk --live 5000 --sidecar-url http://127.0.0.1:8080"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, metavar="NAME")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", type=Path, metavar="FILE",
                        help="JSON lines, one v2 infer request body per line")
    source.add_argument("--live", type=int, metavar="N", help="the next N requests a running sidecar answers")
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="the sidecar's config: Triton's URL, drift.reference_dir, drift.missing_sentinels")
    parser.add_argument("--out", type=Path, metavar="DIR", help="directory to write to (default drift.reference_dir)")
    parser.add_argument("--version", default="", metavar="V",
                        help="send to this model version (--from) or record only its answers (--live), and write "
                             "<model>@<V>.json (default: any version)")
    parser.add_argument("--bins", type=int, default=DEFAULT_BINS, help=f"bins per feature (default {DEFAULT_BINS})")
    parser.add_argument("--sidecar-url", metavar="URL", help="the running sidecar for --live (default "
                        "http://127.0.0.1:<listen.port>, https://localhost:<listen.port> with tls.cert_file set)")
    parser.add_argument("--ca-file", type=Path, metavar="FILE",
                        help="for --live over https: the CA bundle that signed the sidecar's certificate "
                             "(default: the system's)")
    parser.add_argument("--cert-file", type=Path, metavar="FILE",
                        help="for --live to a sidecar with tls.client_ca_file (mutual TLS): this client "
                             "certificate (PEM), with --key-file")
    parser.add_argument("--key-file", type=Path, metavar="FILE", help="the key of --cert-file (PEM, unencrypted)")
    parser.add_argument("--timeout", type=positive_seconds, default=DEFAULT_CALL_TIMEOUT_S, metavar="S",
                        help="bound on each call to Triton; for --live, on the whole recording (default "
                             f"{DEFAULT_CALL_TIMEOUT_S:g} s per call, 600 s live)")
    parser.set_defaults(handler=reporting_usage_errors(_cmd_record_reference))


def _cmd_record_reference(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as e:
        raise CommandError(str(e)) from e
    if not 2 <= args.bins <= 100:
        raise CommandError(f"--bins must be 2..100, got {args.bins}")
    sentinels = config.drift.missing_sentinels.get(args.model, {})
    try:
        if args.source is not None:
            doc = record_from_file(config, args.model, args.version, args.source, bins=args.bins,
                                   sentinels=sentinels, timeout_s=args.timeout)
        else:
            if args.live < MIN_ROWS:
                raise CommandError(f"--live {args.live}: record at least {MIN_ROWS} requests (docs/drift.md)")
            url = args.sidecar_url or (f"https://localhost:{config.listen.port}" if config.tls.enabled
                                       else f"http://127.0.0.1:{config.listen.port}")
            if not url.startswith(("http://", "https://")):
                raise CommandError(f"--sidecar-url must be http://host:port, got {url!r}")
            timeout = args.timeout if args.timeout != DEFAULT_CALL_TIMEOUT_S else 600.0
            doc = record_live(url, args.model, args.live, args.version, bins=args.bins, timeout_s=timeout,
                              context=_client_tls(url, args))
    except _Failed as e:
        print(f"triton-sidecar: record-reference failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    out_dir: Path = args.out or config.drift.reference_dir
    name = f"{args.model}@{args.version}.json" if args.version else f"{args.model}.json"
    path = out_dir / name
    try:
        parse_reference(doc, path)  # what `run` will read back
    except ReferenceFileError as e:
        print(f"triton-sidecar: record-reference failed: the recorded reference is not usable: {e}", file=sys.stderr)
        return EXIT_FAILED
    _write_atomically(path, json.dumps(doc, indent=1) + "\n")
    tensors = ", ".join(f"{n} ({t['features']} features)" for n, t in {**doc["inputs"], **doc["outputs"]}.items())
    print(f"recorded the drift reference of {args.model} from {doc['rows']} rows -> {path}: {tensors}")
    return EXIT_OK


def record_from_file(config: SidecarConfig, model: str, version: str, source: Path, *, bins: int,
                     sentinels: Any, timeout_s: float) -> dict[str, Any]:
    """Send every request of `source` to Triton; the reference of the requests and their answers."""
    import numpy as np

    try:
        lines = [line for line in source.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise CommandError(f"{source}: cannot read the requests file: {e.strerror}") from e
    base = config.triton.url.rstrip("/") + f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
    batched = int(_get_json(base + "/config", timeout_s).get("max_batch_size", 0) or 0) > 0
    inputs: dict[str, tuple[str, list[np.ndarray]]] = {}
    outputs: dict[str, tuple[str, list[np.ndarray]]] = {}
    for number, line in enumerate(lines, 1):
        try:
            body = json.loads(line)
            tensors = [(t["name"], t["datatype"], t["shape"], np.asarray(t["data"], dtype=np.float64))
                       for t in body["inputs"] if t.get("datatype") not in ("BYTES", "BOOL")]
        except (ValueError, KeyError, TypeError) as e:
            raise CommandError(f"{source}:{number}: not a v2 request body with 'data' in every input: {e}") from e
        status, answer = _post(base + "/infer", line.encode(), timeout_s)
        if status != 200:
            raise _Failed(f"{source}:{number}: Triton answered {status}: {answer[:200]!r}")
        _, decoded = answer_tensors(answer, None)
        for store, found in ((inputs, tensors), (outputs, decoded)):
            for name, datatype, shape, values in found:
                rows = int(shape[0]) if batched and shape else 1
                store.setdefault(name, (datatype, []))[1].append(np.asarray(values, np.float64).reshape(rows, -1))
    if not lines:
        raise CommandError(f"{source}: no requests in the file")
    stacked = {kind: {n: (d, np.concatenate(parts)) for n, (d, parts) in store.items()}
               for kind, store in (("inputs", inputs), ("outputs", outputs))}
    rows = len(next(iter(stacked["inputs"].values()))[1]) if stacked["inputs"] else 0
    if rows < MIN_ROWS:
        raise CommandError(f"{source}: {rows} rows; a reference needs at least {MIN_ROWS} (docs/drift.md)")
    return reference_from_values(model, version, stacked["inputs"], stacked["outputs"], bins=bins,
                                 sentinels=sentinels)


def _client_tls(url: str, args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS client context for an https --sidecar-url (None for http://); a file that cannot be
    used is a usage error naming it."""
    given = [name for name in ("ca_file", "cert_file", "key_file") if getattr(args, name) is not None]
    if not url.startswith("https://"):
        if given:
            raise CommandError(f"--{given[0].replace('_', '-')} needs an https:// --sidecar-url, got {url!r}")
        return None
    if (args.cert_file is None) != (args.key_file is None):
        raise CommandError("--cert-file and --key-file go together (a client certificate and its key)")
    try:
        context = ssl.create_default_context(cafile=args.ca_file)
    except (ssl.SSLError, OSError) as e:
        raise CommandError(f"--ca-file {args.ca_file}: not a readable PEM CA bundle: {e}") from e
    if args.cert_file is not None:
        try:
            context.load_cert_chain(args.cert_file, args.key_file)
        except (ssl.SSLError, OSError) as e:
            raise CommandError(f"--cert-file {args.cert_file} / --key-file {args.key_file}: not a usable "
                               f"certificate and key: {e}") from e
    return context


def record_live(sidecar_url: str, model: str, rows: int, version: str, *, bins: int,
                timeout_s: float, context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Ask a running sidecar to record the next `rows` rows it answers for `model` (answered by
    `version` only, when given)."""
    url = f"{sidecar_url.rstrip('/')}/drift/{model}/record?rows={rows}&bins={bins}&timeout_s={timeout_s:g}"
    if version:
        url += f"&version={version}"
    status, body = _post(url, b"", timeout_s + 10, context)
    if status != 200:
        raise _Failed(f"the sidecar at {sidecar_url} answered {status}: {body[:300].decode(errors='replace')}")
    return json.loads(body)  # type: ignore[no-any-return]


def _get_json(url: str, timeout_s: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - the operator's own URL
            return json.loads(response.read())  # type: ignore[no-any-return]
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise _Failed(f"{url}: {e}") from e


def _post(url: str, body: bytes, timeout_s: float, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST",  # noqa: S310 - http(s) only, checked
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:  # noqa: S310
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise _Failed(f"{url}: {e}") from e


def _write_atomically(path: Path, text: str) -> None:
    """Write next to the target and rename: a running sidecar never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
