"""``--reasoning-parser`` end to end: a regex makes the random model think in ``<think>`` tags;
the server splits the thinking into ``reasoning_content``, streamed and not, and leaves it
alone when ``chat_template_kwargs.enable_thinking`` is false."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from quire_engine.server.reasoning import ReasoningParserName
from tests.engine_tests.live_server import RunningServer, serve, sse_payloads, tiny_settings

THINKING = r"<think>[a-z ]{1,12}</think>[a-z]{1,8}"


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[RunningServer]:
    with serve(tiny_settings(reasoning_parser=ReasoningParserName.QWEN3)) as srv:
        yield srv


def answer(server: RunningServer, stream: bool, **extra: Any) -> tuple[str, str | None]:
    """(content, reasoning_content), assembled from the deltas when streaming."""
    body = {
        "messages": [{"role": "user", "content": "Think"}],
        "structured_outputs": {"regex": THINKING},
        "max_tokens": 60,
        "temperature": 0,
        **extra,
    }
    url = f"{server.base_url}/chat/completions"
    if not stream:
        response = httpx2.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        return message["content"], message.get("reasoning_content")
    with httpx2.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        events = sse_payloads(response.iter_lines())
    content, reasoning = "", None
    for event in events[:-1]:
        for choice in event["choices"]:
            content += choice["delta"].get("content") or ""
            if "reasoning_content" in choice["delta"]:
                reasoning = (reasoning or "") + choice["delta"]["reasoning_content"]
    return content, reasoning


def test_thinking_is_reasoning_content(thinking_server: RunningServer) -> None:
    content, reasoning = answer(thinking_server, False)
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert content and content.isalpha()
    assert answer(thinking_server, True) == (content, reasoning)


def test_enable_thinking_false_leaves_the_text_alone(thinking_server: RunningServer) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    content, reasoning = answer(thinking_server, False, **kwargs)
    assert content.startswith("<think>") and "</think>" in content and reasoning is None
    assert answer(thinking_server, True, **kwargs) == (content, None)


def test_include_reasoning_false_drops_it(thinking_server: RunningServer) -> None:
    content, reasoning = answer(thinking_server, False, include_reasoning=False)
    assert reasoning is None and content and "<think>" not in content
