"""Structured outputs (xgrammar): every output that finishes satisfies its schema, regex or
choice. The tiny model's weights are random, so every constraint met is the engine's work.

Schemas are generated with hypothesis within the supported subset and served by real uvicorn
with a KV pool small enough that n = 4 samples of every request preempt each other (recompute
and swap), streamed and not. A ``logit_bias`` toward closing characters (and away from
whitespace) makes documents finish within ``max_tokens``: the bias changes which allowed token
wins, never what is allowed. Examples are derandomized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quire_engine.core.config import PreemptionMode
from tests.engine_tests.live_server import RunningServer, serve, sse_payloads, tiny_settings

# Closing characters up, whitespace down: documents end sooner; what is allowed is unchanged.
BIAS = {str(ord(c)): 4.0 for c in '"}]0123456789,el'} | {str(ord(c)): -100.0 for c in " \n\t\r"}
MESSAGES = [{"role": "user", "content": "JSON please"}]

LEAF = st.sampled_from(
    [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "integer", "minimum": -5, "maximum": 40},
        {"enum": ["red", "green", 7]},
        {"type": "string", "maxLength": 6},
    ]
)
SCHEMAS = st.recursive(
    LEAF,
    lambda inner: (
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 3}, inner)
        | st.dictionaries(
            st.sampled_from(["a", "b", "c", "id"]), inner, min_size=1, max_size=3
        ).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        )
    ),
    max_leaves=5,
)


def valid(value: Any, schema: dict[str, Any]) -> bool:
    """The generated subset of JSON Schema."""
    if "enum" in schema:
        return any(value == v and type(value) is type(v) for v in schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and set(value) == set(props)
            and all(valid(value[k], s) for k, s in props.items())
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(valid(v, schema["items"]) for v in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return value is None


@pytest.fixture(scope="module", params=[PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def tight(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """A pool of 20 blocks of 8 tokens: four samples of ~100 tokens cannot all fit."""
    engine = {
        "num_blocks": 20,
        "block_size": 8,
        "max_model_len": 128,
        "preemption_mode": request.param,
    }
    with serve(tiny_settings(engine)) as srv:
        yield srv


def chat(server: RunningServer, body: dict[str, Any], stream: bool) -> list[tuple[str, str]]:
    """(finish_reason, content) per choice, assembled from the stream when streaming."""
    body = {"messages": MESSAGES, "n": 4, "max_tokens": 80, "seed": 7, "logit_bias": BIAS, **body}
    if not stream:
        response = httpx2.post(f"{server.base_url}/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return [(c["finish_reason"], c["message"]["content"]) for c in response.json()["choices"]]
    with httpx2.stream(
        "POST", f"{server.base_url}/chat/completions", json={**body, "stream": True}, timeout=300
    ) as response:
        assert response.status_code == 200
        events = sse_payloads(response.iter_lines())
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    return [(reasons[i], texts[i]) for i in sorted(texts)]


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schema=SCHEMAS, stream=st.booleans())
def test_json_schema_outputs_that_finish_are_valid(
    tight: RunningServer, schema: dict[str, Any], stream: bool
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    for reason, content in chat(tight, {"response_format": fmt}, stream):
        if reason == "stop":
            assert valid(json.loads(content), schema), (schema, content)


def test_constraints_are_met_under_preemption(tight: RunningServer) -> None:
    """A fixed schema, regex and choice: most samples finish, all of those are valid, and the
    pool really preempted (the same samples streamed and not)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["age", "name"],
    }
    before = tight.metric(
        "quire_preemptions_total", mode=tight.engine.config.scheduler.preemption_mode.value
    )
    finished = 0
    # Four samples of at least 40 tokens each do not fit in the pool together.
    long_list = {"type": "array", "items": {"type": "integer"}, "minItems": 20}
    for stream in (False, True):
        for reason, content in chat(tight, {"structured_outputs": {"json": long_list}}, stream):
            if reason == "stop":
                doc = json.loads(content)
                assert len(doc) >= 20 and all(type(x) is int for x in doc)
        for reason, content in chat(tight, {"structured_outputs": {"json": schema}}, stream):
            if reason == "stop":
                finished += 1
                doc = json.loads(content)
                assert set(doc) == {"name", "age"} and isinstance(doc["age"], int)
        for reason, content in chat(
            tight, {"structured_outputs": {"regex": r"[a-f]{2,5}-\d{3}"}}, stream
        ):
            assert reason == "stop" and re.fullmatch(r"[a-f]{2,5}-\d{3}", content), content
        choices = ["apple", "banana", 'say "hi"\n']
        for reason, content in chat(tight, {"structured_outputs": {"choice": choices}}, stream):
            assert reason == "stop" and content in choices
    assert finished >= 4
    after = tight.metric(
        "quire_preemptions_total", mode=tight.engine.config.scheduler.preemption_mode.value
    )
    assert after > before


def test_control_characters_in_strings_are_escaped(server: RunningServer) -> None:
    """Raw control characters pushed up hard: a finished string is still strict JSON."""
    bias = {str(b): 6.0 for b in range(32)} | {str(ord('"')): 2.0, str(ord("\\")): 3.0}
    body = {
        "messages": MESSAGES,
        "n": 8,
        "max_tokens": 48,
        "seed": 1,
        "logit_bias": bias,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {"type": "string"}},
        },
    }
    choices = httpx2.post(f"{server.base_url}/chat/completions", json=body, timeout=300).json()[
        "choices"
    ]
    done = [c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert done
    for content in done:
        assert isinstance(json.loads(content, strict=True), str)
        assert not any(ord(ch) < 32 for ch in content)


def test_json_object_and_completions(server: RunningServer) -> None:
    client = server.client()
    out = client.completions.create(
        model="tiny",
        prompt="{",
        max_tokens=64,
        n=4,
        seed=2,
        extra_body={"response_format": {"type": "json_object"}, "logit_bias": BIAS},
    )
    assert any(c.finish_reason == "stop" for c in out.choices)
    for c in out.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "parenthesis"),
        ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs", "foo"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": 5}},
                }
            },
            "response_format",
            "Type should be a string",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        (
            {"structured_outputs": {"regex": "a"}, "use_beam_search": True},
            "structured_outputs",
            "beam",
        ),
    ],
)
def test_bad_constraints_are_400_with_the_compilers_message(
    server: RunningServer, body: dict[str, Any], param: str, words: str
) -> None:
    response = httpx2.post(f"{server.base_url}/completions", json={"prompt": "x", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_grammars_compile_once(server: RunningServer) -> None:
    info = server.engine.info
    assert info is not None and info.grammars is not None
    body = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": r"q{1,3}z\d"}}
    httpx2.post(f"{server.base_url}/completions", json=body).raise_for_status()
    compiles = len(info.grammars.compile_seconds)
    httpx2.post(f"{server.base_url}/completions", json=body).raise_for_status()
    assert len(info.grammars.compile_seconds) == compiles
