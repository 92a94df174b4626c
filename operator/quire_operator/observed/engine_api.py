"""The few engine endpoints the operator calls on a replica: the adapters it serves
(``GET /v1/models``), and vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.

Stdlib HTTP with short timeouts: a reconcile must not hang on one replica. Every failure is an
``EngineCallError`` whose ``pending`` says whether it is worth trying again soon (the replica did
not answer in time, or the adapter is still loading there) rather than a refusal that only a
spec change fixes (the engine's 400 on a bad adapter).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

# The engine's error code for a load naming an adapter it is loading or serving
# (quire_engine.server.adapters.ALREADY_LOADED).
ALREADY_LOADED = "lora_adapter_already_loaded"
LIST_TIMEOUT_S = 5.0
# A load reads the adapter's files off the engine's step loop: megabytes, seconds at most.
LOAD_TIMEOUT_S = 60.0
# An unload returns once the requests in flight on the adapter finish; the operator does not
# wait for that (the engine goes on unloading, the next reconcile sees it gone).
UNLOAD_TIMEOUT_S = 5.0


class EngineCallError(RuntimeError):
    def __init__(self, message: str, *, pending: bool = False) -> None:
        super().__init__(message)
        self.pending = pending


def _call(url: str, api_key: str | None, timeout: float, body: dict[str, Any] | None = None) -> Any:
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as err:
        raise _refusal(err) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        raise EngineCallError(f"no answer from {url}: {reason}", pending=True) from None
    try:
        return json.loads(raw) if raw.lstrip().startswith((b"{", b"[")) else raw.decode()
    except ValueError:
        return raw.decode(errors="replace")


def _refusal(err: urllib.error.HTTPError) -> EngineCallError:
    """An OpenAI-shaped error body -> its message; 5xx and "already loaded" are pending."""
    try:
        error = json.loads(err.read()).get("error") or {}
    except (ValueError, AttributeError, OSError):
        error = {}
    message = error.get("message") or f"HTTP {err.code}"
    pending = err.code >= 500 or error.get("code") == ALREADY_LOADED
    return EngineCallError(message, pending=pending)


def served_adapters(base_url: str, api_key: str | None) -> dict[str, str]:
    """The adapters a replica serves: name -> the path it was loaded from (its ``root``)."""
    listed = _call(f"{base_url}/v1/models", api_key, LIST_TIMEOUT_S)
    cards = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(cards, list):
        raise EngineCallError(f"{base_url}/v1/models did not answer a model list", pending=True)
    return {card["id"]: str(card.get("root")) for card in cards if card.get("parent")}


def load_adapter(base_url: str, api_key: str | None, name: str, path: str) -> None:
    body = {"lora_name": name, "lora_path": path}
    _call(f"{base_url}/v1/load_lora_adapter", api_key, LOAD_TIMEOUT_S, body)


def unload_adapter(base_url: str, api_key: str | None, name: str) -> None:
    _call(f"{base_url}/v1/unload_lora_adapter", api_key, UNLOAD_TIMEOUT_S, {"lora_name": name})
