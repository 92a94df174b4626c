"""Fuzz: property-based requests built from the server's own OpenAPI schema (issue 10).

Request bodies are drawn from the request schemas that ``/openapi.json`` publishes, every field
by its declared type: half of them sane (small numbers: mostly served), half hostile (integers
out to beyond int64, floats with NaN and infinities, and sometimes one field replaced by
arbitrary JSON). Properties: never a 5xx; every 4xx in OpenAI's
shape; a 200 is a well-formed completion (or stream, whose error events are OpenAI-shaped); the
server is alive and serving afterwards, with every KV block free. Examples are derandomized, so
every run tries the same inputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from quire_engine.server.reasoning import ReasoningParserName
from quire_engine.server.tool_choice import ToolSettings
from quire_engine.server.tool_parsers import ToolParserName
from tests.engine_tests.live_server import RunningServer, serve, sse_payloads, tiny_settings
from tests.engine_tests.server.test_server_errors import still_serving

EXTREME_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 1e308, float("nan"), float("inf"), float("-inf")]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
# Fields the server rejects whenever they are set (left out of the sane bodies).
UNSUPPORTED = frozenset(
    {"suffix", "response_format", "structured_outputs", "best_of", "stream_options"}
)
PARAMETERS = st.sampled_from(
    [
        None,
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}},
    ]
)
TOOLS = st.lists(
    st.builds(
        lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
        st.sampled_from(["f", "g"]),
        PARAMETERS,
    ),
    max_size=2,
)
# Renders tools (tersely: the fuzzed server's context is 24 tokens).
FUZZ_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools|length }}{% endif %}"
)
# Fields whose schema type is too loose to reach the interesting cases often.
HINTS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([None, "tiny", "tiny", "gpt-5"]),
    "prompt": st.text(max_size=12) | st.lists(st.integers(-2, 400), max_size=6),
    "tools": st.none() | TOOLS,
    "tool_choice": st.sampled_from(
        [
            None,
            "none",
            "auto",
            "required",
            "sometimes",
            {"type": "function", "function": {"name": "f"}},
        ]
    ),
    "chat_template_kwargs": st.sampled_from(
        [None, {"enable_thinking": False}, {"enable_thinking": True}, {"tools": []}]
    ),
}


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[RunningServer]:
    # A short context and few sequences bound the work any one valid request can ask for.
    # Tool calling (auto with the Hermes parser) and the reasoning parser are on.
    engine = {"max_model_len": 24, "max_num_seqs": 4, "num_blocks": 64}
    settings = tiny_settings(
        engine | {"chat_template": FUZZ_TEMPLATE},
        tools=ToolSettings(True, ToolParserName.HERMES),
        reasoning_parser=ReasoningParserName.QWEN3,
    )
    with serve(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def schemas(fuzzed: RunningServer) -> dict[str, Any]:
    return dict(httpx2.get(f"{fuzzed.url}/openapi.json").json()["components"]["schemas"])


def from_schema(schema: dict[str, Any], defs: dict[str, Any], sane: bool, depth: int = 0) -> Any:
    """A hypothesis strategy for the JSON-schema subset FastAPI emits. ``sane`` keeps numbers
    small (most such requests are served); otherwise they reach their extremes."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, sane, depth + 1)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, sane, depth) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=10)
    if kind == "integer":
        return st.integers(0, 4) if sane else st.integers(-3, 40) | st.sampled_from(EXTREME_INTS)
    if kind == "number":
        if sane:
            return st.floats(0, 1)
        return st.floats(-3, 3) | st.sampled_from(EXTREME_FLOATS) | st.integers(-3, 3)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, sane, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object" and "properties" in schema and depth < 4:
        props = schema["properties"]
        required = set(schema.get("required", ()))
        build = {
            k: HINTS[k] if k in HINTS else from_schema(v, defs, sane, depth + 1)
            for k, v in props.items()
            if not sane or k not in UNSUPPORTED
        }
        return st.fixed_dictionaries(
            {k: s for k, s in build.items() if k in required},
            optional={k: s for k, s in build.items() if k not in required},
        )
    return JSON_VALUES


def mutated(bodies: Any) -> Any:
    """Schema-shaped bodies, sometimes with one field replaced by arbitrary JSON."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        body = draw(bodies)
        if isinstance(body, dict) and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(body) or ["prompt"]))
            body[key] = draw(JSON_VALUES)
        return body

    return build()


def check(server: RunningServer, path: str, body: Any) -> None:
    content = json.dumps(body).encode()  # NaN/Infinity as Python's json writes them
    headers = {"content-type": "application/json"}
    with httpx2.stream(
        "POST", f"{server.base_url}/{path}", content=content, headers=headers, timeout=120
    ) as response:
        raw = response.read()
        status = response.status_code
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
    event(f"status {status}")  # --hypothesis-show-statistics: how many got through
    assert status < 500, (status, raw[:500], body)
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], raw
        return
    assert status == 200, raw[:300]
    if streaming:
        events = sse_payloads(raw.decode().splitlines())
        assert events[-1] == "[DONE]", events[-3:]
        for payload in events[:-1]:
            if "error" in payload:  # a request that failed: OpenAI-shaped, never a crash
                assert set(payload["error"]) == {"message", "type", "param", "code"}
            else:
                assert isinstance(payload["choices"], list)
    else:
        assert isinstance(json.loads(raw)["choices"], list)


FUZZ = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.slow  # ~14 s (completions) and ~4 s (chat)
@pytest.mark.parametrize(
    ("path", "schema"),
    [("completions", "CompletionRequest"), ("chat/completions", "ChatCompletionRequest")],
)
def test_fuzzed_requests_never_5xx(
    fuzzed: RunningServer, schemas: dict[str, Any], path: str, schema: str
) -> None:
    spec = schemas[schema]
    bodies = from_schema(spec, schemas, sane=True) | mutated(from_schema(spec, schemas, False))

    @FUZZ
    @given(body=bodies)
    def run(body: Any) -> None:
        check(fuzzed, path, body)

    run()
    assert httpx2.get(f"{fuzzed.url}/health").status_code == 200
    fuzzed.wait_until_idle()
    still_serving(fuzzed)


@FUZZ
@given(garbage=st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_garbage_bodies_are_4xx(fuzzed: RunningServer, garbage: bytes) -> None:
    response = httpx2.post(
        f"{fuzzed.base_url}/completions",
        content=garbage,
        headers={"content-type": "application/json"},
    )
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_schema_documents_openai_errors(schemas: dict[str, Any], fuzzed: RunningServer) -> None:
    paths = httpx2.get(f"{fuzzed.url}/openapi.json").json()["paths"]
    responses = paths["/v1/completions"]["post"]["responses"]
    assert "422" not in responses  # the server answers validation errors with 400
    assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("OpenAIError")
    assert set(schemas["OpenAIError"]["properties"]["error"]["required"]) == {
        "message",
        "type",
        "param",
        "code",
    }
