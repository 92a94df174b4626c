"""Every request field is honoured or refused: vLLM's sampling extensions, prompt logprobs and
``echo``, chat template controls, beam search over HTTP, cached-token usage, lossless logprobs,
and the ``/tokenize``, ``/detokenize`` and ``/version`` routes. Real uvicorn, the openai client
where it can express the request, raw HTTP where it cannot. The tiny model's weights are random,
so each constraint is shown by output the unconstrained model would not produce."""

from __future__ import annotations

import math
from typing import Any

import httpx2
import pytest
import torch

from quire_engine.core.sampling_params import SamplingParams
from quire_engine.model.sampler import SampleRow, sample
from tests.engine_tests.live_server import RunningServer

EOS = 257


def post(server: RunningServer, path: str, body: dict[str, Any], status: int = 200) -> Any:
    response = httpx2.post(f"{server.url}{path}", json=body, timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def ids_of(logprobs: dict[str, Any]) -> list[int]:
    """Token ids of a completions choice asked with ``return_tokens_as_token_ids``."""
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]


def test_echo_logprobs_match_the_generated_ones(server: RunningServer) -> None:
    """lm-eval's loglikelihood request: the prompt's logprobs (first null) equal those the
    model gave the same tokens when it generated them."""
    client = server.client()
    gen = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert gen.choices[0].logprobs is not None
    generated = [int(t.removeprefix("token_id:")) for t in gen.choices[0].logprobs.tokens or []]
    prompt = post(server, "/tokenize", {"prompt": "Hello"})["tokens"] + generated
    echo = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = echo.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = gen.choices[0].logprobs.token_logprobs or []
    got = lp.token_logprobs[len(prompt) - len(generated) : len(prompt)]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(got, expected, strict=True))
    assert echo.choices[0].text.startswith("Hello")


def test_echo_only_and_prompt_logprobs_ignore_the_prefix_cache(server: RunningServer) -> None:
    prompt = "The same long prompt, long enough to fill two blocks of the prefix cache." * 2
    plain = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    post(server, "/v1/completions", plain)
    again = post(server, "/v1/completions", plain)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    first, second = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    for out in (first, second):
        choice = out["choices"][0]
        assert choice["text"] == prompt  # nothing generated
        assert len(choice["logprobs"]["tokens"]) == out["usage"]["prompt_tokens"]
        assert choice["prompt_logprobs"][0] is None
    a, b = (o["choices"][0]["logprobs"]["token_logprobs"][1:] for o in (first, second))
    assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b, strict=True))


def test_logprobs_are_lossless(server: RunningServer) -> None:
    """Byte tokens of multi-byte characters keep their own keys and raw bytes."""
    out = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "日本"}],
            "max_tokens": 12,
            "logprobs": True,
            "top_logprobs": 5,
            "temperature": 1.0,
            "seed": 3,
        },
    )
    content = out["choices"][0]["logprobs"]["content"]
    raw = b"".join(bytes(entry["bytes"]) for entry in content)
    text = out["choices"][0]["message"]["content"]
    decoded = raw.decode("utf-8", "replace")  # an unfinished character at the end is not text
    assert decoded.startswith(text) and set(decoded[len(text) :]) <= {"\ufffd"}
    for entry in content:
        keys = [top["token"] for top in entry["top_logprobs"]]
        assert len(keys) == 5 == len(set(keys))
        assert "\ufffd" not in entry["token"] or bytes(entry["bytes"]) == "\ufffd".encode()
    echo = post(
        server, "/v1/completions", {"prompt": "é日", "max_tokens": 1, "echo": True, "logprobs": 5}
    )
    lp = echo["choices"][0]["logprobs"]
    assert lp["tokens"][1:6] == [
        "bytes:\\xc3",
        "bytes:\\xa9",
        "bytes:\\xe6",
        "bytes:\\x97",
        "bytes:\\xa5",
    ]
    assert all(len(top) >= 5 for top in lp["top_logprobs"][1:])
    # Offsets count characters of the echoed text, which has no "<s>".
    assert lp["text_offset"] == [0, 0, 0, 1, 1, 1, 2]


def test_sampling_extensions_are_honoured(server: RunningServer) -> None:
    base = {"prompt": "Hi", "logprobs": 0, "return_tokens_as_token_ids": True, "seed": 1}
    allowed = post(
        server,
        "/v1/completions",
        {**base, "max_tokens": 16, "n": 4, "allowed_token_ids": [65, 66, 67]},
    )
    for choice in allowed["choices"]:
        assert set(ids_of(choice["logprobs"])) <= {65, 66, 67}
    banned = post(
        server,
        "/v1/completions",
        {**base, "max_tokens": 24, "n": 4, "allowed_token_ids": [65, 66], "bad_words": ["AB"]},
    )
    for choice in banned["choices"]:
        assert "AB" not in choice["text"] and choice["text"]
    floor = post(
        server,
        "/v1/completions",
        {**base, "max_tokens": 8, "n": 8, "min_tokens": 5, "allowed_token_ids": [65, EOS]},
    )
    for choice in floor["choices"]:
        assert EOS not in ids_of(choice["logprobs"])[:5]
        assert len(choice["logprobs"]["tokens"]) >= 5
    biased = post(
        server,
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "logit_bias": {"90": 100}},
    )
    assert biased["choices"][0]["text"] == "ZZZZZZ"


def test_repetition_penalty_follows_vllm() -> None:
    """Seen tokens (prompt or output): positive logits divided, negative multiplied."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=4)
    result = sample(logits, [SampleRow(params, None, [1], prompt_token_ids=[0])])
    assert result.top_logprobs is not None
    expected = torch.log_softmax(torch.tensor([1.0, -4.0, 1.0, 3.0]), 0)
    assert all(
        math.isclose(result.top_logprobs[0][t], float(expected[t]), abs_tol=1e-6) for t in range(4)
    )


def test_beam_search_over_http(server: RunningServer) -> None:
    out = post(
        server,
        "/v1/completions",
        {"prompt": "Hello", "use_beam_search": True, "n": 3, "max_tokens": 5},
    )
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and len(set(texts)) == 3


def test_chat_template_controls(server: RunningServer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    template = "{{ greeting }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    kwargs = {"chat_template": template, "chat_template_kwargs": {"greeting": "Yo"}}
    tokens = post(server, "/tokenize", {"messages": messages, **kwargs, "return_token_strs": True})
    assert "".join(tokens["token_strs"]) == "Yo[hi][Sure]"
    out = post(
        server,
        "/v1/chat/completions",
        {
            "messages": messages,
            "chat_template": template,
            "chat_template_kwargs": {"greeting": "Yo"},
            "max_tokens": 2,
        },
    )
    assert out["usage"]["prompt_tokens"] == tokens["count"]
    cont = post(
        server,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 3,
            "echo": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert cont["choices"][0]["message"]["content"].startswith("Sure")
    default = post(
        server,
        "/tokenize",
        {"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert default["tokens"][-1] != ord("\n")  # the final message stays open


def test_tokenize_detokenize_version(server: RunningServer) -> None:
    out = post(server, "/tokenize", {"model": "tiny", "prompt": "héllo"})
    assert out == {"count": 7, "max_model_len": out["max_model_len"], "tokens": out["tokens"]}
    assert post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": False})["tokens"] == [
        104,
        105,
    ]
    assert post(server, "/detokenize", {"tokens": out["tokens"][1:]}) == {"prompt": "héllo"}
    assert httpx2.get(f"{server.url}/version").json()["version"]
    post(server, "/detokenize", {"tokens": [10**6]}, status=400)
    post(server, "/tokenize", {"model": "gpt-5", "prompt": "x"}, status=404)
    post(server, "/tokenize", {"prompt": "x", "messages": [{"role": "user"}]}, status=400)


@pytest.mark.parametrize(
    "field",
    [
        {"priority": 1},
        {"vllm_xargs": {"a": 1}},
        {"skip_special_tokens": False},
        {"stream_interval": 4},
        {"logprob_token_ids": [1]},
    ],
)
def test_known_but_unbuilt_fields_are_refused(server: RunningServer, field: dict[str, Any]) -> None:
    error = post(server, "/v1/completions", {"prompt": "a", **field}, status=400)["error"]
    assert error["param"] == next(iter(field)) and next(iter(field)) in error["message"]


def test_neutral_values_and_unknown_fields_are_accepted(server: RunningServer) -> None:
    body = {
        "prompt": "a",
        "max_tokens": 1,
        "priority": 0,
        "skip_special_tokens": True,
        "session_id": "s",
        "some_future_field": {"x": 1},
    }
    assert post(server, "/v1/completions", body)["usage"]["completion_tokens"] == 1
