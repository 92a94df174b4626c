"""Tool calling end to end: real uvicorn, the openai client, the tiny random-weight model.

Named and ``required`` tool choices are the grammar's work, so every call that finishes parses
and is valid for its function (tool schemas drawn with hypothesis, n = 4 samples preempting
each other in a small pool, streamed and not). ``auto`` is the parser's work: a regex forces
the random model to write a Hermes call, which the server must read out of the text. The
template is the tiny model's own (``tiny_model.CHAT_TEMPLATE``, Hermes/Qwen-style: it renders
tools, calls and tool answers), so named and ``required`` calls work on the default server with
no flag.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quire_engine.server.tool_choice import ToolSettings
from quire_engine.server.tool_parsers import ToolParserName
from tests.engine_tests.live_server import RunningServer, serve, sse_payloads, tiny_settings
from tests.engine_tests.structured.test_structured_outputs import BIAS, SCHEMAS, valid

MESSAGES = [{"role": "user", "content": "Weather?"}]


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def params_schema(inner: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"a": inner},
        "required": ["a"],
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def tools_server() -> Iterator[RunningServer]:
    """Auto tool choice with the Hermes parser; a pool of 32 blocks of 8 tokens, so that four
    samples of ~150 tokens cannot all fit (preemption)."""
    engine = {
        "num_blocks": 32,
        "block_size": 8,
        "max_model_len": 256,
    }
    with serve(tiny_settings(engine, tools=ToolSettings(True, ToolParserName.HERMES))) as srv:
        yield srv


def chat(server: RunningServer, body: dict[str, Any], stream: bool) -> list[dict[str, Any]]:
    """Per choice: finish_reason, content and tool_calls ({"id", "name", "arguments"}),
    assembled from the deltas when streaming."""
    body = {"messages": MESSAGES, "max_tokens": 80, "seed": 7, **body}
    url = f"{server.base_url}/chat/completions"
    if not stream:
        response = httpx2.post(url, json=body, timeout=300)
        assert response.status_code == 200, response.text
        return [
            {
                "finish_reason": c["finish_reason"],
                "content": c["message"]["content"],
                "tool_calls": [
                    {"id": t["id"], **t["function"]} for t in c["message"].get("tool_calls") or []
                ],
            }
            for c in response.json()["choices"]
        ]
    with httpx2.stream("POST", url, json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200
        events = sse_payloads(response.iter_lines())
    choices: dict[int, dict[str, Any]] = {}
    for event in events[:-1]:
        for c in event["choices"]:
            out = choices.setdefault(
                c["index"], {"finish_reason": None, "content": None, "tool_calls": []}
            )
            delta = c["delta"]
            if delta.get("content"):
                out["content"] = (out["content"] or "") + delta["content"]
            for call in delta.get("tool_calls", []):
                calls = out["tool_calls"]
                if call["index"] == len(calls):
                    assert call["type"] == "function"
                    calls.append({"id": call["id"], **call["function"]})
                else:
                    assert set(call) == {"index", "function"}
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
            if c["finish_reason"]:
                out["finish_reason"] = c["finish_reason"]
    return [choices[i] for i in sorted(choices)]


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    schemas=st.lists(SCHEMAS, min_size=1, max_size=2),
    named=st.booleans(),
    parallel=st.booleans(),
    stream=st.booleans(),
)
def test_named_and_required_calls_are_valid(
    tools_server: RunningServer,
    schemas: list[dict[str, Any]],
    named: bool,
    parallel: bool,
    stream: bool,
) -> None:
    tools = [tool(f"f{k}", params_schema(s)) for k, s in enumerate(schemas)]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    choice: Any = {"type": "function", "function": {"name": "f0"}} if named else "required"
    body = {
        "tools": tools,
        "tool_choice": choice,
        "n": 4,
        "logit_bias": BIAS,
        "parallel_tool_calls": parallel,
    }
    for out in chat(tools_server, body, stream):
        if out["finish_reason"] == "length":
            continue
        assert out["finish_reason"] == "tool_calls", out
        calls = out["tool_calls"]
        assert calls and (parallel or len(calls) == 1), out
        for call in calls:
            assert call["id"].startswith("chatcmpl-tool-")
            assert not named or call["name"] == "f0"
            assert valid(json.loads(call["arguments"]), by_name[call["name"]]), (call, by_name)


def test_calls_survive_preemption(tools_server: RunningServer) -> None:
    """Long arguments for four samples at once: the pool preempts, and finished calls are valid."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    long_list = {"type": "array", "items": digit, "minItems": 12, "maxItems": 16}
    tools = [tool("numbers", params_schema(long_list))]
    before = tools_server.metric("quire_preemptions_total", mode="recompute")
    finished = 0
    for stream in (False, True):
        for choice in ("required", {"type": "function", "function": {"name": "numbers"}}):
            body = {"tools": tools, "tool_choice": choice, "n": 4, "logit_bias": BIAS}
            for out in chat(tools_server, {**body, "max_tokens": 100}, stream):
                if out["finish_reason"] == "tool_calls":
                    finished += 1
                    (call,) = out["tool_calls"][:1]
                    args = json.loads(call["arguments"])
                    assert 12 <= len(args["a"]) <= 16 and all(0 <= x <= 9 for x in args["a"])
    assert finished >= 4
    assert tools_server.metric("quire_preemptions_total", mode="recompute") > before


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "w"}}])
def test_a_streamed_call_is_the_non_streamed_one(tools_server: RunningServer, choice: Any) -> None:
    obj = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
    body = {
        "tools": [tool("w", obj), tool("t")],
        "tool_choice": choice,
        "temperature": 0,
        "logit_bias": BIAS,
    }
    plain, streamed = chat(tools_server, body, False), chat(tools_server, body, True)
    strip = [{**c, "tool_calls": [{**t, "id": ""} for t in c["tool_calls"]]} for c in plain]
    assert strip == [
        {**c, "tool_calls": [{**t, "id": ""} for t in c["tool_calls"]]} for c in streamed
    ]
    assert plain[0]["finish_reason"] == "tool_calls"


HERMES_CALL = (
    r'Checking\. <tool_call>\{"name": "weather", "arguments": \{"city": "[a-z]{1,6}"\}\}'
    r"</tool_call>"
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls(tools_server: RunningServer, stream: bool) -> None:
    """A regex makes the random model write a Hermes call; the parser finds it."""
    obj = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = {
        "tools": [tool("weather", obj)],
        "structured_outputs": {"regex": HERMES_CALL},
        "max_tokens": 100,
    }
    (out,) = chat(tools_server, body, stream)
    assert out["finish_reason"] == "tool_calls", out
    assert out["content"] == "Checking. "
    (call,) = out["tool_calls"]
    assert call["name"] == "weather"
    assert set(json.loads(call["arguments"])) == {"city"}


def test_auto_without_a_call_is_content(tools_server: RunningServer) -> None:
    body = {"tools": [tool("weather")], "structured_outputs": {"regex": "[a-z]{3,8}"}}
    (out,) = chat(tools_server, body, False)
    assert out["finish_reason"] == "stop" and out["content"] and not out["tool_calls"]


def test_openai_client_round_trip(tools_server: RunningServer) -> None:
    """The openai client's types: a named call, then the call and its answer sent back."""
    client = tools_server.client()
    obj = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}}
    tools: Any = [tool("weather", obj)]
    # The stubs want their message TypedDicts and integer biases; the API takes plain dicts and
    # numbers, which is what this sends.
    first = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny",
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=40,
        logit_bias={int(k): v for k, v in BIAS.items()},
    )
    message = first.choices[0].message
    assert message.tool_calls and first.choices[0].finish_reason in ("tool_calls", "length")
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather"
    follow_up: Any = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=follow_up, tools=tools, tool_choice="none", max_tokens=4
    )
    assert second.choices[0].message.tool_calls is None


def test_tool_messages_render(tools_server: RunningServer) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tokens = httpx2.post(
        f"{tools_server.url}/tokenize", json={"messages": messages, "tools": [tool("weather")]}
    ).json()["tokens"]
    text = httpx2.post(f"{tools_server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "Tools: weather" in text
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|tool|>\ncall_1: sunny" in text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [tool("w")], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [tool("w")], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [tool("w"), tool("w")], "tool_choice": "required"}, "tools"),
        ({"tools": [tool("w", {"type": "object", "minProperties": "x"})],
          "tool_choice": "required"}, "tools"),
        ({"tools": [tool("w")], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [tool("w")], "tool_choice": "required", "use_beam_search": True}, None),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(
    tools_server: RunningServer, body: dict[str, Any], param: str | None
) -> None:
    response = httpx2.post(
        f"{tools_server.base_url}/chat/completions", json={"messages": MESSAGES, **body}
    )
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_the_default_server_calls_tools_with_no_flags(server: RunningServer) -> None:
    """The embedded model's template renders tools: named and required calls work through the
    openai client; auto is refused until the server reads calls (as vLLM)."""
    # Plain dicts and integer biases, as the API takes them (the client's stubs want TypedDicts).
    client: Any = server.client()
    obj = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}}
    tools: Any = [tool("weather", obj), tool("time")]
    bias = {int(k): v for k, v in BIAS.items()}
    named: Any = {"type": "function", "function": {"name": "weather"}}
    for choice in (named, "required"):
        out = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=tools,
            tool_choice=choice,
            max_tokens=60,
            logit_bias=bias,
            temperature=0,
        )
        (call, *_) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls", out
        assert call.function.name in {"weather", "time"}
        assert choice == "required" or call.function.name == "weather"
        assert isinstance(json.loads(call.function.arguments), dict)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, max_tokens=2)
