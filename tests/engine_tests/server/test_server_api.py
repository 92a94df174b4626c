"""The OpenAI-compatible API driven by the official ``openai`` client (sync and async) against
real uvicorn: completions, chat, streaming, n, stop strings, seeds, logprobs, vLLM's extra fields.

The embedded model has fixed random weights and a byte tokenizer (ids 0-255 are bytes, BOS 256),
so its greedy outputs are fixed noise; a few tests rely on one such output (asserted first)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx2

from quire_engine.core.outputs import RequestOutput
from quire_engine.model.tiny_model import build_tokenizer
from tests.engine_tests.live_server import EngineHolder, RunningServer, serve, tiny_settings

NO_EOS = {"ignore_eos": True}
# Greedy output of PROMPT begins with four printable bytes: 43 '+', 64 '@', 63 '?', 48 '0'
# (other outputs of the noise model are mostly partial UTF-8 and stream as few chunks).
PROMPT, PREFIX = "abc", "+@?0"


def greedy(server: RunningServer, prompt: str | list[int], max_tokens: int = 8) -> str:
    response = server.client().completions.create(
        model="tiny", prompt=prompt, temperature=0, max_tokens=max_tokens, extra_body=NO_EOS
    )
    return response.choices[0].text


def test_models_lists_the_served_name_and_context(server: RunningServer) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].owned_by == "quire"
    assert (models.data[0].model_extra or {})["max_model_len"] == 256


def test_completion_shape_and_usage(server: RunningServer) -> None:
    response = server.client().completions.create(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=5, extra_body=NO_EOS
    )
    assert response.object == "text_completion"
    assert response.model == "tiny" and response.id.startswith("cmpl-")
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    usage = response.usage
    assert usage is not None
    assert usage.prompt_tokens == len(PROMPT.encode()) + 1  # bytes + BOS
    assert usage.completion_tokens == 5 and usage.total_tokens == usage.prompt_tokens + 5


def test_the_request_id_header_names_the_request_as_vllm_does(server: RunningServer) -> None:
    api = server.client()
    named = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_headers={"X-Request-Id": "gw-1"}
    )
    assert named.id == "cmpl-gw-1"
    # The header wins over the body's field, as in vLLM.
    both = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_headers={"X-Request-Id": "gw-2"},
        extra_body={"request_id": "body-2"},
    )
    assert both.id == "chatcmpl-gw-2"


def test_streaming_arrives_in_chunks_and_ends_with_usage() -> None:
    """A chunk per engine step that adds text. Outputs are cumulative and a client slower than
    the engine gets bigger deltas (async_engine), so how many chunks arrive depends on the two
    speeds: here, while the output is within PREFIX, a step that added text makes the next step
    wait (a minute at most) until the client has received that text's chunk."""
    holder = EngineHolder()
    received = threading.Semaphore(0)
    with serve(tiny_settings(engine_factory=holder)) as server:
        full = greedy(server, PROMPT, max_tokens=8)
        assert full.startswith(PREFIX)
        engine = holder.engine
        step, shown, wait = engine.step, [0], [False]

        def gated() -> list[RequestOutput]:
            if wait[0]:
                received.acquire(timeout=60)
            outputs = step()
            text = next((o.outputs[0].text for o in outputs if o.outputs), "")
            wait[0] = shown[0] < len(text) <= len(PREFIX)
            shown[0] = max(shown[0], len(text))
            return outputs

        engine.step = gated  # type: ignore[method-assign]
        try:
            stream = server.client().completions.create(
                model="tiny",
                prompt=PROMPT,
                temperature=0,
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=NO_EOS,
            )
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                received.release()
        finally:
            del engine.step
    content, final = chunks[:-1], chunks[-1]
    assert [c.choices[0].text for c in content[: len(PREFIX)]] == list(PREFIX), "one per step"
    assert all(c.choices and c.usage is None for c in content)
    assert "".join(c.choices[0].text for c in content) == full
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == 8


def test_sse_wire_format_ends_with_done(server: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx2.stream("POST", f"{server.base_url}/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


def test_chat_is_the_completion_of_the_templated_prompt(server: RunningServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = server.client().chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]  # plain dicts, as users send them
        temperature=0,
        max_tokens=6,
        extra_body=NO_EOS,
    )
    tokenizer = build_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    (choice,) = chat.choices
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == greedy(server, ids, max_tokens=6)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)


def test_async_client_streams_chats_concurrently(server: RunningServer) -> None:
    async def chat(client: object, content: str, stream: bool) -> str:
        kwargs: dict[str, object] = {"model": "tiny"}
        kwargs["messages"] = [{"role": "user", "content": content}]
        kwargs |= {"temperature": 0, "max_tokens": 6, "extra_body": NO_EOS}
        if not stream:
            response = await client.chat.completions.create(**kwargs)  # type: ignore[attr-defined]
            return response.choices[0].message.content
        roles, parts = [], []
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):  # type: ignore[attr-defined]
            roles.append(chunk.choices[0].delta.role)
            parts.append(chunk.choices[0].delta.content or "")
        assert roles[0] == "assistant" and set(roles[1:]) <= {None}
        return "".join(parts)

    async def main() -> None:
        async with server.async_client() as client:
            streamed = await asyncio.gather(chat(client, "one", True), chat(client, "two", True))
            whole = await asyncio.gather(chat(client, "one", False), chat(client, "two", False))
        assert streamed == whole

    asyncio.run(main())


def test_n2_samples_differ_and_a_seed_reproduces_them(server: RunningServer) -> None:
    client = server.client()
    kwargs = {"model": "tiny", "prompt": PROMPT, "n": 2, "temperature": 1.0, "max_tokens": 8}
    kwargs |= {"extra_body": NO_EOS}
    first = client.completions.create(**kwargs, seed=1234)  # type: ignore[call-overload]
    again = client.completions.create(**kwargs, seed=1234)  # type: ignore[call-overload]
    other = client.completions.create(**kwargs, seed=99)  # type: ignore[call-overload]
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.text for c in again.choices]
    assert texts[0] != texts[1]
    assert texts != [c.text for c in other.choices]
    assert first.usage is not None and first.usage.completion_tokens == 16
    streamed = ["", ""]
    for chunk in client.completions.create(**kwargs, seed=1234, stream=True):  # type: ignore[call-overload]
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_stop_string_across_tokens_and_stop_token(server: RunningServer) -> None:
    client = server.client()
    assert greedy(server, PROMPT, max_tokens=6).startswith(PREFIX)
    kwargs = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 12}
    stopped = client.completions.create(**kwargs, stop=["@?", "zz"])  # type: ignore[call-overload]
    (choice,) = stopped.choices
    assert choice.text == "+" and choice.finish_reason == "stop"
    assert (choice.model_extra or {})["stop_reason"] == "@?"
    # Streaming must not have sent the "@" before the "?" revealed the stop string.
    parts = [
        c.choices[0].text
        for c in client.completions.create(**kwargs, stop="@?", stream=True)  # type: ignore[call-overload]
        if c.choices
    ]
    assert "".join(parts) == "+"
    by_token = client.completions.create(**kwargs, extra_body={"stop_token_ids": [ord("0")]})  # type: ignore[call-overload]
    assert by_token.choices[0].text == PREFIX  # the stop token's text is kept, as in vLLM
    assert (by_token.choices[0].model_extra or {})["stop_reason"] == ord("0")


def test_extra_body_top_k_and_min_p_reduce_to_greedy(server: RunningServer) -> None:
    expected = greedy(server, PROMPT, max_tokens=6)
    client = server.client()
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        response = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            temperature=1.0,
            max_tokens=6,
            extra_body={**extra, **NO_EOS},
        )
        assert response.choices[0].text == expected, extra


def test_logprobs_in_both_shapes(server: RunningServer) -> None:
    client = server.client()
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2, extra_body=NO_EOS
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert sampled is not None and sampled <= 0
        assert sampled == max(top.values())  # greedy picks the most likely token
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == item.top_logprobs[0].logprob
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )


def test_several_prompts_in_one_request(server: RunningServer) -> None:
    ids = [5, 6, 7, 8]
    response = server.client().completions.create(
        model="tiny", prompt=[ids, [9, 10]], temperature=0, max_tokens=4, n=2, extra_body=NO_EOS
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    texts = [c.text for c in response.choices]
    assert texts[0] == texts[1] == greedy(server, ids, max_tokens=4)
    assert texts[2] == texts[3] == greedy(server, [9, 10], max_tokens=4)
    assert response.usage is not None and response.usage.prompt_tokens == 6
