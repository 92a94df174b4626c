"""The LoRA adapters a server serves, by the names clients put in ``model``.

Ownership: ``AdapterRegistry`` owns the name -> ``LoRARequest`` table of one app (the ids it
hands out, from 1), what each adapter is doing (loading, served, failed, unloading), the static
ones of ``--lora-modules`` (loaded once the engine is ready, before ``/ready`` says so) and the
runtime ones of ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. The engine loads the
files off its step loop (``AsyncEngine.load_adapter``); an unload stops new requests at once and
returns when the requests in flight on the adapter have finished.

``--lora-modules`` takes vLLM's two forms: ``name=path`` and the JSON object
``{"name": ..., "path": ..., "base_model_name": ...}``. A relative path is resolved under
``--lora-dir`` when one is set (the operator mounts adapter volumes under one directory and names
adapters relative to it); ``hf://org/name[@revision]`` is downloaded from the Hub (``HF_ENDPOINT``,
``HF_TOKEN``) into ``$HF_HOME/quire-adapters`` off the step loop, verified, and loaded from there.
``/v1/models`` shows each adapter's path as it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from huggingface_hub.errors import HfHubHTTPError

from quire_engine import hub_cache
from quire_engine.core.lora import LoRARequest
from quire_engine.engine.async_engine import AsyncEngine
from quire_engine.engine.engine_thread import EngineState
from quire_engine.engine.request_handle import EngineUnavailable
from quire_engine.server.protocol import OpenAIError

logger = logging.getLogger(__name__)

# The error code of a load naming an adapter that is loaded or loading.
ALREADY_LOADED = "lora_adapter_already_loaded"
# Where hf:// adapters are downloaded, under HF_HOME.
ADAPTER_DOWNLOADS = "quire-adapters"
# How often the static adapters' loader looks whether the engine is ready yet.
READY_POLL_S = 0.05


class AdapterState(enum.Enum):
    LOADING = "loading"
    SERVED = "served"
    FAILED = "failed"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """``name=path`` or vLLM's JSON form; ``ValueError`` for anything else."""
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
                return cls(data["name"], data["path"], data.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"--lora-modules {text!r}: {err}") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path or a JSON object; got {text!r}")
        return cls(name, path)


@dataclass(slots=True)
class _Entry:
    request: LoRARequest  # lora_path: resolved under --lora-dir
    source: str  # the path as given (what /v1/models shows as its root)
    state: AdapterState
    error: str = ""


class ServedAdapter(NamedTuple):
    """An adapter ``/v1/models`` lists."""

    name: str
    source: str


def _fetch(uri: str) -> Path:
    """An hf:// adapter's local directory (downloaded now unless already there); every failure
    is a ``ValueError`` saying what the Hub or the files said (a 400 to the caller)."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    try:
        return hub_cache.fetch_adapter(uri, home / ADAPTER_DOWNLOADS)
    except ValueError:
        raise
    except (hub_cache.CacheError, HfHubHTTPError, OSError) as err:
        raise ValueError(f"cannot fetch {uri}: {type(err).__name__}: {err}") from err


class AdapterRegistry:
    """See the module docstring. Event loop only."""

    def __init__(
        self,
        engine: AsyncEngine,
        base_names: tuple[str, ...],
        modules: tuple[LoRAModule, ...] = (),
        *,
        runtime_updates: bool = False,
        lora_dir: str | None = None,
    ) -> None:
        self.engine = engine
        self.base_names = base_names
        self.runtime_updates = runtime_updates
        self.lora_dir = lora_dir
        self._ids = itertools.count(1)
        self._entries: dict[str, _Entry] = {}
        self._static = [self._register(m.name, m.path) for m in modules]
        self.static_done = not self._static

    def _register(self, name: str, path: str) -> LoRARequest:
        if name in self.base_names or name in self._entries:
            raise ValueError(f"LoRA adapter name {name!r} is already served")
        resolved = path
        if self.lora_dir and not path.startswith(hub_cache.HUB_SCHEME):
            resolved = os.path.join(self.lora_dir, path)
        request = LoRARequest(name, next(self._ids), resolved)
        self._entries[name] = _Entry(request, path, AdapterState.LOADING)
        return request

    # ---- lookups ---------------------------------------------------------------------------
    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model; 404 otherwise."""
        if model is None or model in self.base_names:
            return None
        entry = self._entries.get(model)
        if entry is not None and entry.state is AdapterState.SERVED:
            return entry.request
        why = f": {entry.error}" if entry is not None and entry.error else ""
        raise OpenAIError(
            404, f"The model `{model}` does not exist{why}.", param="model", code="model_not_found"
        )

    def served(self) -> list[ServedAdapter]:
        return [
            ServedAdapter(e.request.lora_name, e.source)
            for e in self._entries.values()
            if e.state is AdapterState.SERVED
        ]

    # ---- static adapters -------------------------------------------------------------------
    async def load_static(self) -> None:
        """Load the ``--lora-modules`` adapters once the engine is ready (a task of the app's
        lifespan); an adapter that fails is logged and answered 404 with the reason."""
        try:
            while self.engine.state is EngineState.LOADING:
                await asyncio.sleep(READY_POLL_S)
            for request in self._static:
                with contextlib.suppress(ValueError, EngineUnavailable):  # logged by _load
                    await self._load(request)
        finally:
            self.static_done = True

    async def _load(self, request: LoRARequest) -> None:
        entry = self._entries[request.lora_name]
        try:
            if request.lora_path.startswith(hub_cache.HUB_SCHEME):
                local = await asyncio.to_thread(_fetch, request.lora_path)
                request = entry.request = dataclasses.replace(request, lora_path=str(local))
            await self.engine.load_adapter(request)
        except (ValueError, EngineUnavailable) as err:
            entry.state, entry.error = AdapterState.FAILED, str(err)
            name, path = request.lora_name, request.lora_path
            logger.error("LoRA adapter %s (%s) not served: %s", name, path, err)
            raise
        entry.state = AdapterState.SERVED
        logger.info("LoRA adapter %s served from %s", request.lora_name, request.lora_path)

    # ---- runtime updates -------------------------------------------------------------------
    def _check_runtime(self) -> None:
        if not self.runtime_updates:
            raise OpenAIError(
                404,
                "runtime LoRA updating is off (--allow-runtime-lora-updating, or vLLM's "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                code="not_found",
            )

    async def load(self, name: str, path: str) -> str:
        self._check_runtime()
        entry = self._entries.get(name)
        if entry is not None and entry.state is not AdapterState.FAILED:
            # The code tells a caller that repeats a load (the operator, after a timeout) that
            # this name is taken, apart from every other 400.
            loading = " (still loading)" if entry.state is AdapterState.LOADING else ""
            raise OpenAIError(
                400, f"LoRA adapter {name!r} is already loaded{loading}", param="lora_name",
                code=ALREADY_LOADED,
            )  # fmt: skip
        if entry is not None:
            del self._entries[name]  # a failed one may be loaded again
        try:
            request = self._register(name, path)
        except ValueError as err:
            raise OpenAIError(400, str(err), param="lora_name") from err
        try:
            await self._load(request)
        except ValueError as err:
            del self._entries[name]
            raise OpenAIError(400, str(err), param="lora_path") from err
        except EngineUnavailable:
            del self._entries[name]
            raise
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        self._check_runtime()
        entry = self._entries.get(name)
        if entry is None or entry.state is not AdapterState.SERVED:
            raise OpenAIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                code="not_found",
            )  # fmt: skip
        entry.state = AdapterState.UNLOADING  # new requests get 404 from now on
        try:
            await self.engine.unload_adapter(entry.request.lora_int_id)
        finally:
            del self._entries[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
