"""Per-model request specs: what a valid request looks like, built from Triton's own metadata and
config once per model (and version), and built again after the model is reloaded (a reload may
change its inputs).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import rapidjson

from sidecar.serving.filtering import OutputFilter
from sidecar.serving.refusals import Reason, Refusal
from sidecar.serving.request_rules import RequestRules
from sidecar.serving.validation import Limits, ModelSpec, build_model_spec
from sidecar.states import ModelState, ModelStates, Transition

#: Fetch one of a model's documents ("metadata" or "config") from Triton: (HTTP status, body).
#: Raises UpstreamFailure when Triton gives no answer.
FetchDocument = Callable[[str, str, str], Awaitable[tuple[int, bytes]]]

#: Told (model, version) when a spec is fetched and cached ("" = the unversioned one).
CachedListener = Callable[[str, str], None]


class SpecCache:
    def __init__(self, *, fetch: FetchDocument, states: ModelStates, limits: Limits, output_filter: OutputFilter,
                 rules: Mapping[str, RequestRules], retry_after_s: int) -> None:
        self._fetch = fetch
        self._limits = limits
        self._filter = output_filter
        self._rules = rules
        self._retry_after_s = retry_after_s
        self._specs: dict[tuple[str, str], ModelSpec] = {}
        self._fetching: dict[tuple[str, str], asyncio.Task[ModelSpec]] = {}
        #: Bumped when a model is reloaded: a fetch begun before the reload is not cached.
        self._generation: collections.Counter[str] = collections.Counter()
        self._cached_listeners: list[CachedListener] = []
        states.add_listener(self._on_transition)

    def add_cached_listener(self, listener: CachedListener) -> None:
        """Hear of each spec as it is cached: the Rust front publishes it at once, so the next
        request to that version is the front's (it never fetches a spec itself)."""
        self._cached_listeners.append(listener)

    def _on_transition(self, t: Transition) -> None:
        if t.state_to is ModelState.HEALING or (t.state_to.serves_traffic and not t.state_from.serves_traffic):
            self.forget(t.model)

    def reconfigure(self, *, limits: Limits, output_filter: OutputFilter, rules: Mapping[str, RequestRules]) -> None:
        """New validation and filtering settings: every spec is built again on its next request."""
        self._limits, self._filter, self._rules = limits, output_filter, rules
        for model in {key[0] for key in [*self._specs, *self._fetching]}:
            self.forget(model)

    def forget(self, model: str) -> None:
        self._generation[model] += 1
        for key in [k for k in self._specs if k[0] == model]:
            del self._specs[key]

    def cached(self, model: str, version: str) -> ModelSpec | None:
        """The spec if it was fetched already (the Rust front's lanes need one; they never fetch)."""
        return self._specs.get((model, version))

    def cached_versions(self, model: str) -> dict[str, ModelSpec]:
        """The specs fetched for versions of the model named by number (pinned requests), by version."""
        return {version: spec for (name, version), spec in self._specs.items() if name == model and version}

    async def get(self, model: str, version: str) -> ModelSpec:
        """The spec, fetched once; concurrent requests share one fetch."""
        key = (model, version)
        spec = self._specs.get(key)
        if spec is not None:
            return spec
        task = self._fetching.get(key)
        if task is None:
            task = asyncio.create_task(self._build(model, version, self._generation[model]),
                                       name=f"spec:{model}:{version}")
            self._fetching[key] = task
            task.add_done_callback(lambda _t: self._fetching.pop(key, None))
        # shield: one client giving up must not cancel the fetch other requests wait on
        return await asyncio.shield(task)

    async def _build(self, model: str, version: str, generation: int) -> ModelSpec:
        metadata = await self._document(model, version, "metadata")
        config = await self._document(model, version, "config", optional=True)
        spec = build_model_spec(model, version, metadata, config, limits=self._limits,
                                is_hidden=self._filter.for_model(model), rules=self._rules.get(model))
        if self._generation[model] == generation:
            self._specs[(model, version)] = spec
            for listener in self._cached_listeners:
                listener(model, version)
        return spec

    async def _document(self, model: str, version: str, what: str, *, optional: bool = False) -> dict[str, Any]:
        """`optional`: a 404 means the server has no such endpoint (MLServer has no model config;
        Triton answers 400 for a model it does not know), and the document is empty."""
        status, body = await self._fetch(model, version, what)
        if status == 404 and optional:
            return {}
        if status == 200:
            try:
                doc = rapidjson.loads(body)
            except ValueError as e:
                raise Refusal(Reason.TRITON_BAD_ANSWER, f"Triton's {what} of {model} is not JSON", model=model,
                              before_triton=False) from e
            if isinstance(doc, dict):
                return doc
        message = triton_error_message(body)
        if status in (400, 404) and version:
            raise Refusal(Reason.UNKNOWN_MODEL, f"model {model}: {message}", model=model)
        raise Refusal(Reason.MODEL_UNAVAILABLE, f"Triton does not serve model {model} right now "
                                                f"({status}: {message})", model=model,
                      retry_after=self._retry_after_s, before_triton=False)


def triton_error_message(body: bytes) -> str:
    """Triton's `{"error": ...}` text, or the start of whatever it answered."""
    try:
        doc = rapidjson.loads(body)
        message = doc.get("error", "") if isinstance(doc, dict) else ""
    except ValueError:
        message = ""
    text = str(message or body[:200].decode(errors="replace") or "(empty answer)")
    return text if len(text) <= 300 else text[:297] + "..."

