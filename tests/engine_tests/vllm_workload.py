"""A deterministic workload for the metric tests, run once on its own live server, and what it
must leave on ``/metrics``.

Fixed token-id prompts, greedy, ``ignore_eos`` and known ``max_tokens``, on a pool of 8 blocks of
16 tokens (``max_model_len`` 128), one request after the other:

1. two 20-token prompts in one completions request (one command to the engine thread, so both
   are scheduled in the same step), 60 tokens each: at 64 tokens each they hold all 8 blocks,
   and the next block can only come from preempting the newer one (recompute), which re-prefills
   once the older one has finished;
2. a 40-token prompt (4 tokens), then a prompt sharing its first 32 tokens (``n=2``, 4 tokens
   each): two full blocks, 32 tokens, found in the prefix cache;
3. a streamed chat completion (5 tokens, usage in the last chunk);
4. a prompt whose first greedy token (known from the offline engine) is its stop token: finished
   with reason "stop" after one token.

Nothing else shares a full block with another prompt, and the preempted prompt's second lookup
is not counted (only a request's first), so the prefix cache is hit exactly 32 times.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypedDict

import httpx2

from quire_engine import LLM, SamplingParams
from tests.engine_tests.live_server import RunningServer, Samples, serve, tiny_settings
from tests.engine_tests.ties import assert_tie_free

POOL = {"num_blocks": 8, "max_model_len": 128}


class Greedy(TypedDict):
    """The keywords that make an openai client request greedy and blind to EOS."""

    temperature: float
    extra_body: dict[str, object]


PAIR = [list(range(10, 30)), list(range(40, 60))]  # 20 tokens each
PAIR_TOKENS = 60
SHARED = list(range(100, 140))  # 40 tokens; the next prompt shares its first two blocks
SHARING = SHARED[:32] + list(range(200, 208))
PREFIX_HIT_TOKENS = 32
STOPPED = list(range(60, 70))


@dataclass
class Workload:
    server: RunningServer
    samples: Samples  # every sample of /metrics once the server is idle again
    text: str  # the same scrape as exposition text
    prompt_tokens: int  # the sum of the responses' usage
    completion_tokens: int
    finished: dict[str, int]  # engine requests by finish reason
    samples_generated: int  # sample streams (choices) that generated tokens
    n_sum: int  # sum of the requests' n
    max_tokens_sum: int  # sum of the requests' max_tokens
    longest_sum: int  # sum over requests of their longest sample's tokens


def first_greedy_token(prompt: list[int]) -> int:
    """The token greedy decoding picks first for ``prompt``, from the offline engine (the same
    weights; alone in its batch, as the server will run it; checked tie-free)."""
    llm = LLM(device="cpu", num_blocks=16, max_model_len=128)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2))
    assert_tie_free(out)
    return out[0].outputs[0].token_ids[0]


@contextmanager
def run_workload() -> Iterator[Workload]:
    stop_token = first_greedy_token(STOPPED)
    greedy: Greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    with serve(tiny_settings(POOL)) as server, server.client() as client:
        pair = client.completions.create(
            model="tiny", prompt=PAIR, max_tokens=PAIR_TOKENS, **greedy
        )
        shared = client.completions.create(model="tiny", prompt=SHARED, max_tokens=4, **greedy)
        sharing = client.completions.create(
            model="tiny", prompt=SHARING, max_tokens=4, n=2, **greedy
        )
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Metrics, please."}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
                **greedy,
            )
        )
        stopped = client.completions.create(
            model="tiny",
            prompt=STOPPED,
            max_tokens=8,
            temperature=0,
            extra_body={"stop_token_ids": [stop_token]},
        )
        usages = [r.usage for r in (pair, shared, sharing, stopped)] + [chunks[-1].usage]
        totals = [(u.prompt_tokens, u.completion_tokens) for u in usages if u is not None]
        assert len(totals) == len(usages)
        stopped_tokens = totals[3][1]
        reasons: list[str | None] = [c.finish_reason for r in (pair, shared) for c in r.choices]
        chat_reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        reasons += [sharing.choices[0].finish_reason, chat_reason, stopped.choices[0].finish_reason]
        assert reasons == ["length"] * 5 + ["stop"], reasons
        samples = server.wait_until_idle()
        yield Workload(
            server=server,
            samples=samples,
            text=httpx2.get(f"{server.url}/metrics").text,
            prompt_tokens=sum(p for p, _ in totals),
            completion_tokens=sum(c for _, c in totals),
            finished={"length": 5, "stop": 1, "abort": 0},
            samples_generated=2 + 1 + 2 + 1 + 1,
            n_sum=1 + 1 + 1 + 2 + 1 + 1,
            max_tokens_sum=2 * PAIR_TOKENS + 4 + 4 + 5 + 8,
            longest_sum=2 * PAIR_TOKENS + 4 + 4 + 5 + stopped_tokens,
        )
