"""LoRA affinity end to end: the operator's Endpoint Picker (GIE v1.5.0's ``lora-affinity-scorer``
at its default weight) reading the engines' ``vllm:lora_requests_info``, Envoy as the Gateway, and
real engines serving the same adapters with one adapter slot per step (``spec.lora.maxLoras: 1``;
the operator loads the adapters into every replica).

The same traffic goes through the picker and through the plain Service (Envoy at random over the
same engines); where each adapter's requests went is read from the engines' own per-adapter
counters (``quire_lora_requests_total``), so nothing here depends on timing.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster.gateway import Gateway
from tests.cluster.pod_runner import PodProcess
from tests.e2e.lora_adapters import make_tiny_adapters
from tests.e2e.routed_fleet import (
    TIMEOUT_S,
    RoutedFleet,
    client,
    engine_series,
    first_answer,
    save_report,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ADAPTERS = ("sql", "chat")
MAX_LORA_RANK = 8
# Per adapter: closed-loop streams, each sending its requests one after the other. Fewer streams
# than an engine's running slots (max_num_seqs), so an adapter's requests never queue behind each
# other on its replica and only the picker's choices put requests in a queue.
STREAMS = 4
REQUESTS_PER_STREAM = 12
REQUESTS = STREAMS * REQUESTS_PER_STREAM
# Each adapter's share on its most-used replica. Through the Service (random over 2 replicas) it
# is 0.5 plus binomial noise: with 48 requests an adapter's share reaches 0.8 about once in 60000
# runs, and the mean of the two adapters' shares 0.7 about once in 10000.
PICKER_SHARE = 0.8
MARGIN_OVER_SERVICE = 0.1


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The adapters every replica serves: random peft adapters of the tiny model, on the host
    (where the pod runner runs the engines)."""
    return make_tiny_adapters(tmp_path_factory.mktemp("adapters"), ADAPTERS, MAX_LORA_RANK)


def lora_spec(adapters: Mapping[str, Path]) -> dict[str, Any]:
    """spec.lora serving ``adapters`` (file://, on the host) with one adapter slot per step."""
    listed = [{"name": name, "uri": f"file://{path}"} for name, path in adapters.items()]
    return {"maxLoras": 1, "maxLoraRank": MAX_LORA_RANK, "adapters": listed}


def served_models(engine: PodProcess) -> set[str]:
    api = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)
    try:
        return {m.id for m in api.models.list()}
    finally:
        api.close()


def lora_requests(engines: Sequence[PodProcess]) -> dict[str, dict[str, float]]:
    """Requests admitted so far, per engine address, per adapter."""
    return {e.address: engine_series(e, "quire_lora_requests_total", "lora_name") for e in engines}


def send(gateway: Gateway, models: Sequence[str]) -> list[str]:
    """STREAMS closed-loop streams per model, started interleaved; the errors, if any. Every
    prompt starts differently, so no replica holds any of them: the prefix scorer has nothing to
    prefer and the adapter is what places a request."""
    errors: list[str] = []
    lock = threading.Lock()

    def stream(model: str) -> None:
        api = client(gateway, timeout=120)
        for _ in range(REQUESTS_PER_STREAM):
            try:
                api.completions.create(
                    model=model,
                    prompt=f"{uuid.uuid4().hex} write me a query",
                    max_tokens=16,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            except openai.OpenAIError as err:
                with lock:
                    errors.append(f"{model}: {type(err).__name__}: {err}")
        api.close()

    workers = [
        threading.Thread(target=stream, args=(model,), daemon=True)
        for _ in range(STREAMS)
        for model in models
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
    assert not any(w.is_alive() for w in workers), "a stream hung"
    return errors


def placement(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, int]]:
    """Per adapter, the requests each engine admitted between the two readings."""
    return {
        name: {
            address: round(after[address].get(name, 0.0) - before[address].get(name, 0.0))
            for address in after
        }
        for name in ADAPTERS
    }


def top_shares(placed: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    return {name: max(per.values()) / sum(per.values()) for name, per in placed.items()}


def test_an_adapters_requests_go_to_the_replica_running_it_while_it_has_room(
    fleet: Callable[..., RoutedFleet], adapters: dict[str, Path]
) -> None:
    # 2 replicas, 2 adapters, one adapter slot each: a replica running `sql` scores 1 for `sql`
    # and 0 for `chat` (no free slot), the other the reverse, so the picker keeps each adapter on
    # one replica. Through the Service every replica serves both, switching adapters as its
    # running requests drain.
    f = fleet("lora", 2, num_blocks=256, max_num_seqs=8, lora=lora_spec(adapters))
    gateway, service = f.gateway(), f.service()
    first_answer(gateway, f.name)
    engines = f.runner.engines()
    # The operator loads both adapters into every replica once it is ready.
    wait_until(
        lambda: all(served_models(e) == {f.name, *ADAPTERS} for e in engines) or None,
        timeout=TIMEOUT_S,
        interval=0.2,
        message="both adapters loaded on every replica",
    )

    readings = [lora_requests(engines)]
    errors = {"pool": send(gateway, ADAPTERS)}
    readings.append(lora_requests(engines))
    errors["service"] = send(service, ADAPTERS)
    readings.append(lora_requests(engines))

    placed = {
        "pool": placement(readings[0], readings[1]),
        "service": placement(readings[1], readings[2]),
    }
    shares = {path: top_shares(p) for path, p in placed.items()}
    report = {"placed": placed, "top_replica_share": shares, "errors": errors}
    save_report("lora affinity", report)
    detail = json.dumps(report, indent=1)
    assert errors == {"pool": [], "service": []}, detail
    # Every request reached exactly one engine, under its adapter's name.
    for path in placed.values():
        assert {name: sum(per.values()) for name, per in path.items()} == dict.fromkeys(
            ADAPTERS, REQUESTS
        ), detail
    assert min(shares["pool"].values()) >= PICKER_SHARE, detail
    # With one slot per replica the two adapters settle on different replicas.
    homes = {max(per, key=per.__getitem__) for per in placed["pool"].values()}
    assert len(homes) == len(ADAPTERS), detail
    mean = {path: sum(s.values()) / len(s) for path, s in shares.items()}
    assert mean["pool"] >= mean["service"] + MARGIN_OVER_SERVICE, detail
