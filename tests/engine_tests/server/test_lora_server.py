"""LoRA adapters over HTTP, with the official openai client on a real uvicorn: ``model`` selects
an adapter (static ``--lora-modules`` or loaded at runtime), ``/v1/models`` lists adapters with
their parent, unknown names are 404, bad adapters are clear 400s, an unload lets the requests in
flight finish, and ``/metrics`` shows ``vllm:lora_requests_info`` and per-adapter counters."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx2
import openai
import pytest

from quire_engine.engine.vllm_metrics import LoRAState, VllmCollector
from quire_engine.server.adapters import ALREADY_LOADED
from tests.engine_tests.live_server import RunningServer, serve, tiny_settings
from tests.engine_tests.model.test_lora import (
    PROMPTS,
    make_adapter,
    reference,
    tie_free_prefix,
)
from tests.engine_tests.models import build
from tests.hub_server import HubServer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    base = build("llama", root / "base")
    (_, a_ref), (_, b_ref) = (
        make_adapter(base, root, "a", 1, 8, ["q_proj", "v_proj", "down_proj"]),
        make_adapter(base, root, "b", 2, 4, ["o_proj", "up_proj"]),
    )
    make_adapter(base, root, "wide", 3, 16, ["q_proj"])  # rank 16: above the server's 8
    narrow = build("llama", root / "narrow", intermediate_size=96)
    make_adapter(narrow, root, "foreign", 4, 2, ["gate_proj"])
    return {"root": root, "base": base, "a_ref": a_ref, "b_ref": b_ref}


@pytest.fixture(scope="module")
def server(checkpoints: dict[str, Path]) -> Iterator[RunningServer]:
    root = checkpoints["root"]
    engine = {
        "model": str(checkpoints["base"]),
        "dtype": "float32",
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
    }
    settings = tiny_settings(
        engine,
        served_model_names=("base",),
        lora_modules=(f"a={root / 'a'}",),  # absolute: --lora-dir leaves it as it is
        allow_runtime_lora_updating=True,
        lora_dir=str(root),
    )
    with serve(settings) as running:
        yield running


def greedy(server: RunningServer, model: str, prompt: list[int], max_tokens: int = 16) -> list[int]:
    out = server.client().completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert out.model == model
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def post(server: RunningServer, path: str, body: Mapping[str, object]) -> httpx2.Response:
    return httpx2.post(f"{server.url}{path}", json=body, timeout=60)


def test_models_lists_the_adapters_with_their_parent(
    server: RunningServer, checkpoints: dict[str, Path]
) -> None:
    assert {m.id for m in server.client().models.list().data} >= {"base", "a"}
    cards = {c["id"]: c for c in httpx2.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["a"]["parent"] == "base" and "parent" not in cards["base"]
    assert cards["a"]["root"] == str(checkpoints["root"] / "a")


def test_model_selects_the_adapter(server: RunningServer, checkpoints: dict[str, Path]) -> None:
    base_ref = str(checkpoints["base"])
    for model, ref in (("a", str(checkpoints["a_ref"])), ("base", base_ref)):
        for i, prompt in enumerate(PROMPTS[:2]):
            expected, margins = reference(ref)[i]
            n = tie_free_prefix(margins)
            assert greedy(server, model, prompt)[:n] == expected[:n], (model, i)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().completions.create(model="nope", prompt="hi", max_tokens=1)


def test_runtime_load_refusals_and_unload_after_in_flight(
    server: RunningServer, checkpoints: dict[str, Path]
) -> None:
    root = checkpoints["root"]
    bad = [
        ({"lora_name": "x", "lora_path": str(root / "nowhere")}, "peft adapter directory"),
        ({"lora_name": "wide", "lora_path": str(root / "wide")}, "rank 16; max_lora_rank is 8"),
        ({"lora_name": "foreign", "lora_path": str(root / "foreign")}, "another base model"),
        ({"lora_name": "a", "lora_path": "a"}, "already loaded"),
        ({"lora_name": "base", "lora_path": str(root / "a")}, "already served"),
    ]
    for body, message in bad:
        answer = post(server, "/v1/load_lora_adapter", body)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], body
        taken = answer.json()["error"]["code"] == ALREADY_LOADED
        assert taken == (message == "already loaded"), answer.json()
    # A relative path is resolved under --lora-dir; /v1/models shows it as it was given.
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"})
    assert answer.status_code == 200, answer.text
    cards = {c["id"]: c for c in httpx2.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["b"]["root"] == "b" and cards["b"]["parent"] == "base"
    expected, margins = reference(str(checkpoints["b_ref"]))[0]
    n = tie_free_prefix(margins)
    assert greedy(server, "b", PROMPTS[0])[:n] == expected[:n]

    # A long request on b is in flight when b is unloaded: it finishes whole, then b is gone.
    first_chunk, done = threading.Event(), threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        stream = server.client().completions.create(
            model="b", prompt=PROMPTS[2], max_tokens=120, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, reason = "", None
        for chunk in stream:
            first_chunk.set()
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        result["reason"] = reason
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    assert first_chunk.wait(60)
    answer = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert answer.status_code == 200, answer.text
    worker.join(60)
    assert done.is_set() and result["reason"] == "length"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="b", prompt="hi", max_tokens=1)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    server.wait_until_idle()


def test_metrics_count_per_adapter_and_report_the_slots(server: RunningServer) -> None:
    before = server.metrics().get(("quire_lora_requests_total", (("lora_name", "a"),)), 0.0)
    greedy(server, "a", PROMPTS[2], max_tokens=20)
    m = server.wait_until_idle()
    assert m[("quire_lora_requests_total", (("lora_name", "a"),))] == before + 1
    assert m[("quire_lora_generation_tokens_total", (("lora_name", "a"),))] >= 20
    assert m[("quire_lora_prompt_tokens_total", (("lora_name", "a"),))] >= len(PROMPTS[2])
    # Idle: no adapter running or waiting (which ones are is unit-tested on the scheduler's
    # stats and the collector, where a step's state can be held still).
    (info,) = [dict(labels) for (name, labels) in m if name == "vllm:lora_requests_info"]
    assert info == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_lora_requests_info_names_the_running_and_waiting_adapters() -> None:
    collector = VllmCollector("m", [])
    collector.set_lora(LoRAState(2, {1: "a", 2: "b", 3: "c"}, (1, 3), (2,)))
    (family,) = [f for f in collector.collect() if f.name == "vllm:lora_requests_info"]
    (sample,) = family.samples
    assert sample.labels == {
        "max_lora": "2",
        "running_lora_adapters": "a,c",
        "waiting_lora_adapters": "b",
    }


def test_an_adapter_named_by_its_hub_repository_is_downloaded_and_served(
    server: RunningServer,
    checkpoints: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``hf://org/name[@revision]``: fetched from the Hub (here a stand-in, as HF_ENDPOINT) into
    HF_HOME off the step loop, verified, then served; a repository the Hub does not have is a
    400 saying so."""
    hub = HubServer("quire-test/lora-b", checkpoints["root"] / "b").start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        uri = f"hf://quire-test/lora-b@{hub.commit}"
        answer = post(server, "/v1/load_lora_adapter", {"lora_name": "hub-b", "lora_path": uri})
        assert answer.status_code == 200, answer.text
        local = tmp_path / "hf-home" / "quire-adapters" / "quire-test/lora-b" / f"@{hub.commit}"
        assert (local / ".quire-complete.json").is_file()
        cards = {c["id"]: c for c in httpx2.get(f"{server.url}/v1/models").json()["data"]}
        assert cards["hub-b"]["root"] == uri
        expected, margins = reference(str(checkpoints["b_ref"]))[1]
        n = tie_free_prefix(margins)
        assert greedy(server, "hub-b", PROMPTS[1])[:n] == expected[:n]
        missing = {"lora_name": "gone", "lora_path": "hf://quire-test/nowhere"}
        answer = post(server, "/v1/load_lora_adapter", missing)
        assert answer.status_code == 400, answer.text
        assert "cannot fetch hf://quire-test/nowhere: RepositoryNotFoundError" in answer.text
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "hub-b"}).status_code == 200
    finally:
        hub.stop()
    server.wait_until_idle()
