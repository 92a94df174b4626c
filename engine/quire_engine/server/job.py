"""A submitted HTTP request on its way out: :class:`Job` and its two ways of answering, one JSON
response once every prompt finished (:func:`respond`) or server-sent events as outputs arrive
(:func:`stream`).

Ownership: a job owns its ``RequestHandle`` and the watcher task that aborts it when the client
disconnects (:func:`abort_on_disconnect`); both ways out close the job in a ``finally`` block,
whatever happens, so a gone client or a failed render frees its blocks within one engine step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from quire_engine.core.outputs import RequestOutput
from quire_engine.engine.request_handle import EngineUnavailable, RequestHandle
from quire_engine.server.errors import internal_error, request_failed, unavailable
from quire_engine.server.protocol import Json
from quire_engine.server.rendering import (
    ChatRenderer,
    CompletionRenderer,
    Renderer,
    prompt_logprobs_json,
    stream_choices,
    usage,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    """A submitted HTTP request on its way out. ``close()`` must run whatever happens."""

    handle: RequestHandle
    watcher: asyncio.Task[None]  # aborts the handle when the client disconnects
    renderer: Renderer
    head: Json  # id, created, model
    n: int
    num_prompt_tokens: int

    def close(self) -> None:
        self.watcher.cancel()
        self.handle.abort()


async def respond(job: Job) -> Response:
    """One JSON response once every prompt finished: the choices in order and the usage; 499
    (read by nobody) when the client left first."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in job.handle.outputs():
            finals[index] = out
            if job.handle.error is not None:
                break  # close() aborts the other prompts
    except EngineUnavailable as exc:
        raise unavailable(exc) from exc
    finally:
        job.close()
    if job.handle.error is not None:
        raise request_failed(job.handle.error)
    if job.handle.aborted:
        return Response(status_code=499)  # the client is gone; nobody reads this
    renderer = job.renderer
    choices = []
    for index, out in sorted(finals.items()):
        renderer.observe(index, out)
        for sample in out.outputs:
            choice = renderer.full_choice(index * job.n + sample.index, sample)
            if isinstance(renderer, CompletionRenderer) and out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(renderer.text, out.prompt_logprobs)
            choices.append(choice)
    completion_tokens = sum(len(s.token_ids) for out in finals.values() for s in out.outputs)
    response = {**job.head, "object": renderer.object, "choices": choices}
    if isinstance(renderer, ChatRenderer) and finals and finals[0].prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(renderer.text, finals[0].prompt_logprobs)
    response["usage"] = usage(job.num_prompt_tokens, completion_tokens, renderer.cached_tokens)
    return JSONResponse(response)


async def stream(job: Job, include_usage: bool, holdback: int) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice update, the usage chunk if asked, ``[DONE]``.
    ``holdback``: characters a choice holds back while they may still begin a stop string."""
    head = {**job.head, "object": job.renderer.chunk_object}
    extra: Json = {"usage": None} if include_usage else {}
    try:
        completion_tokens = 0
        async for choice, tokens in stream_choices(job.handle, job.renderer, job.n, holdback):
            completion_tokens += tokens
            yield _event({**head, "choices": [choice], **extra})
            if job.handle.error is not None:
                break  # close() aborts the other prompts
        if job.handle.error is not None:
            yield _event(request_failed(job.handle.error).body())
        elif job.handle.aborted:
            return
        elif include_usage:
            totals = usage(job.num_prompt_tokens, completion_tokens, job.renderer.cached_tokens)
            yield _event({**head, "choices": [], "usage": totals})
    except EngineUnavailable as exc:
        yield _event(unavailable(exc).body())
    except Exception as exc:  # the response has started: report in the stream, not as a 500
        logger.exception("streaming %s failed", job.head["id"])
        yield _event(internal_error(exc).body())
    finally:
        job.close()
    yield "data: [DONE]\n\n"


async def abort_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """Abort ``handle`` when the client disconnects (run as a job's watcher task)."""
    # The body has been read, so the next ASGI message is the disconnect (uvicorn sends it when
    # the socket closes, whether or not the response started).
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.abort()


def _event(payload: Json) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
