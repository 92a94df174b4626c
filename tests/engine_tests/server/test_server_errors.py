"""Every error answers the right status in OpenAI's shape, and the server keeps serving after it:
validation 400 (never 422), unsupported fields 400, context too long 400
``context_length_exceeded``, unknown model or route 404, API key 401, body too large 413, not
ready or dead 503 with Retry-After."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx2
import openai
import pytest

from quire_engine.core.config import EngineConfig
from quire_engine.engine.llm_engine import LLMEngine
from tests.engine_tests.live_server import RunningServer, serve, tiny_settings

MESSAGES = [{"role": "user", "content": "hi"}]


def error_of(response: httpx2.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def still_serving(server: RunningServer, **headers: str) -> None:
    body = {"prompt": "abc", "max_tokens": 2}
    response = httpx2.post(f"{server.base_url}/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"max_tokens": 2}, "prompt"),  # missing field
        ("completions", {"prompt": 5}, "prompt"),  # wrong type
        ("completions", {"prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ("completions", {"prompt": "a", "temperature": -1}, "temperature"),  # SamplingParams
        ("completions", {"prompt": "a", "n": 0}, "n"),
        ("completions", {"prompt": "a", "top_p": 0}, "top_p"),
        ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [1, 100000]}, "prompt"),  # token id out of the vocabulary
        ("completions", {"prompt": "a", "suffix": "b"}, "suffix"),
        ("completions", {"prompt": "a", "watermarking": True}, "watermarking"),  # vLLM's, refused
        ("completions", {"prompt": "a", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ("completions", {"prompt": "a", "length_penalty": 0.5}, "length_penalty"),
        ("completions", {"prompt": "a", "logit_bias": {"x": 1.0}}, "logit_bias"),
        ("completions", {"prompt": "a", "logit_bias": {"100000": 1.0}}, "logit_bias"),
        ("completions", {"prompt": "a", "logit_bias": {"5": 101.0}}, "logit_bias"),
        ("completions", {"prompt": "a", "allowed_token_ids": [100000]}, "allowed_token_ids"),
        ("completions", {"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids"),
        ("completions", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ("completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt": "a", "bad_words": [""]}, "bad_words"),
        ("completions", {"prompt": "a", "use_beam_search": True, "logprobs": 1}, "logprobs"),
        ("completions", {"prompt": "a", "use_beam_search": True, "stop": "x"}, "stop"),
        (
            "chat/completions",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs",
        ),
        ("chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        ("completions", {"prompt": "a", "stream_options": {"include_usage": True}}, None),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_invalid_requests_are_400(
    server: RunningServer, path: str, body: dict[str, object], param: str | None
) -> None:
    error = error_of(httpx2.post(f"{server.base_url}/{path}", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_the_request_that_killed_the_server_is_a_400(server: RunningServer) -> None:
    # Issue 10: a seed beyond int64 was half-added, and the next engine step died.
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "seed": 18446744073709551616}
    error = error_of(httpx2.post(f"{server.base_url}/completions", json=body), 400)
    assert error["param"] == "seed" and "9223372036854775807" in str(error["message"])
    still_serving(server)


BEYOND_INT64 = 2**64
NUMERIC_EXTREMES: dict[str, list[object]] = {
    "temperature": [-1e-9, 2.5, 1e308, BEYOND_INT64, "0.5", True, [1]],
    "top_p": [0, -0.1, 1.01, "1"],
    "top_k": [-2, 2**63, BEYOND_INT64, 1.5, "5"],
    "min_p": [-0.5, 1.5, "0"],
    "presence_penalty": [-2.01, 2**70, "1"],
    "frequency_penalty": [2.01, -(2**70), False],
    "n": [0, -1, 1025, 65, BEYOND_INT64, 1.0, "2"],  # 65 > max_num_seqs=64
    "seed": [2**63, -(2**63) - 1, BEYOND_INT64, 1.5, "7"],
    "max_tokens": [0, -1, -(2**70), BEYOND_INT64, 2.0, "8"],
    "logprobs": [-1, 21, BEYOND_INT64, "1"],
    "stop": [[""], ["x"] * 33, ["y" * 257], 5],
    "stop_token_ids": [[-1], [320], [BEYOND_INT64], list(range(33)), ["1"]],
    "best_of": [2, -1],
}


@pytest.mark.parametrize(
    ("field", "value"), [(f, v) for f, values in NUMERIC_EXTREMES.items() for v in values]
)
def test_every_numeric_field_at_its_extremes_is_a_400(
    server: RunningServer, field: str, value: object
) -> None:
    body = {"prompt": "abc", "max_tokens": 2, field: value}
    beyond_context = field == "max_tokens" and value == BEYOND_INT64
    code = "context_length_exceeded" if beyond_context else None
    error = error_of(httpx2.post(f"{server.base_url}/completions", json=body), 400)
    assert error["param"] == field and error["code"] == code, error


def test_nan_and_infinity_are_400(server: RunningServer) -> None:
    # Python's json (and so FastAPI) reads these non-standard literals as floats.
    for literal in ("NaN", "Infinity", "-Infinity"):
        for field in ("temperature", "top_p", "presence_penalty"):
            content = f'{{"prompt": "abc", "max_tokens": 2, "{field}": {literal}}}'
            response = httpx2.post(
                f"{server.base_url}/completions",
                content=content.encode(),
                headers={"content-type": "application/json"},
            )
            assert error_of(response, 400)["param"] == field
    chat = {"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}
    response = httpx2.post(f"{server.base_url}/chat/completions", json=chat)
    assert error_of(response, 400)["param"] == "top_logprobs"
    chat = {"messages": MESSAGES, "max_completion_tokens": 0}
    response = httpx2.post(f"{server.base_url}/chat/completions", json=chat)
    assert error_of(response, 400)["param"] == "max_tokens"
    still_serving(server)


def test_malformed_json_is_400_and_the_server_keeps_serving(server: RunningServer) -> None:
    response = httpx2.post(
        f"{server.base_url}/completions",
        content=b'{"prompt": ',
        headers={"content-type": "application/json"},
    )
    error_of(response, 400)
    still_serving(server)


def test_context_length_exceeded(server: RunningServer) -> None:
    url = f"{server.base_url}/completions"
    too_long = error_of(httpx2.post(url, json={"prompt": "x" * 300}), 400)
    assert too_long["code"] == "context_length_exceeded" and too_long["param"] == "prompt"
    assert "maximum context length is 256 tokens" in str(too_long["message"])
    assert "301 input tokens" in str(too_long["message"])
    with_output = error_of(httpx2.post(url, json={"prompt": "x" * 200, "max_tokens": 100}), 400)
    assert with_output["code"] == "context_length_exceeded" and with_output["param"] == "max_tokens"
    assert "(100 > 256 - 201)" in str(with_output["message"])
    chat = {"messages": [{"role": "user", "content": "y" * 300}]}
    error = error_of(httpx2.post(f"{server.base_url}/chat/completions", json=chat), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    # Through the openai client: a BadRequestError carrying the code.
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().completions.create(model="tiny", prompt="x" * 300, max_tokens=1)
    assert raised.value.code == "context_length_exceeded"
    still_serving(server)


def test_unknown_model_route_and_method(server: RunningServer) -> None:
    body = {"model": "gpt-5", "prompt": "a"}
    error = error_of(httpx2.post(f"{server.base_url}/completions", json=body), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-5", messages=MESSAGES)  # type: ignore[arg-type]
    error_of(httpx2.get(f"{server.base_url}/nowhere"), 404)
    error_of(httpx2.get(f"{server.base_url}/completions"), 405)
    still_serving(server)


@pytest.fixture(scope="module")
def guarded() -> Iterator[RunningServer]:
    with serve(tiny_settings(api_key="s3cret", max_body_bytes=4096)) as running:
        yield running


def test_api_key_guards_v1_only(guarded: RunningServer) -> None:
    url = f"{guarded.base_url}/completions"
    body = {"prompt": "abc", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
        error = error_of(httpx2.post(url, json=body, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    error_of(httpx2.get(f"{guarded.base_url}/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()
    assert guarded.client(api_key="s3cret").models.list().data[0].id == "tiny"
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx2.get(f"{guarded.url}{open_path}").status_code == 200
    for docs in ("/docs", "/openapi.json"):  # the schema follows the key too
        assert error_of(httpx2.get(f"{guarded.url}{docs}"), 401)["code"] == "invalid_api_key"
        ok = httpx2.get(f"{guarded.url}{docs}", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    still_serving(guarded, authorization="Bearer s3cret")


def test_the_key_is_checked_before_the_body_is_read(guarded: RunningServer) -> None:
    url = f"{guarded.base_url}/completions"
    malformed = httpx2.post(
        url, content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert error_of(malformed, 401)["code"] == "invalid_api_key"  # not a 400: nothing was parsed
    big = httpx2.post(url, json={"prompt": "a" * 5000})
    assert error_of(big, 401)["code"] == "invalid_api_key"  # not a 413


def test_body_over_the_limit_is_413(guarded: RunningServer) -> None:
    url = f"{guarded.base_url}/completions"
    auth = {"authorization": "Bearer s3cret"}
    big = {"prompt": "a" * 5000}
    error = error_of(httpx2.post(url, json=big, headers=auth), 413)  # Content-Length
    assert error["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while it is read
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    headers = {**auth, "content-type": "application/json"}
    error = error_of(httpx2.post(url, content=chunked(), headers=headers), 413)
    assert error["code"] == "request_too_large"
    still_serving(guarded, **auth)


def test_not_ready_while_loading_then_ready() -> None:
    release = threading.Event()

    def slow_load(config: EngineConfig) -> LLMEngine:
        release.wait(timeout=30)
        return LLMEngine(config)

    with serve(tiny_settings(engine_factory=slow_load), wait_ready=False) as loading:
        assert httpx2.get(f"{loading.url}/health").status_code == 200  # alive, loading
        ready = httpx2.get(f"{loading.url}/ready")
        error = error_of(ready, 503)
        assert error["code"] == "not_ready" and ready.headers["retry-after"] == "5"
        response = httpx2.post(f"{loading.base_url}/completions", json={"prompt": "a"})
        assert error_of(response, 503)["code"] == "not_ready"
        assert response.headers["retry-after"] == "5"
        release.set()
        loading.wait_until_ready()
        still_serving(loading)


def test_dead_engine_fails_health_and_requests() -> None:
    deaths: list[bool] = []

    def broken(config: EngineConfig) -> LLMEngine:
        raise RuntimeError("no such device")

    settings = tiny_settings(engine_factory=broken, on_engine_death=lambda: deaths.append(True))
    with serve(settings, wait_ready=False) as dead:
        dead.wait_until(lambda: bool(deaths), "engine death reported")
        error_of(httpx2.get(f"{dead.url}/health"), 503)
        error_of(httpx2.get(f"{dead.url}/ready"), 503)
        response = httpx2.post(f"{dead.base_url}/completions", json={"prompt": "a"})
        assert error_of(response, 503)["code"] == "engine_down"
        assert "retry-after" in response.headers
