"""The host tier under the prefix cache (``--kv-offloading-size``), on and off, in one run with
the same device pool, on three workloads whose working set is several times that pool:

- ``multi_turn``: conversations whose next turn extends the previous prompt (its prompt, the
  answer, a new user message), every conversation's turn before anyone's next one, so a
  conversation's prefix is evicted from the device pool by the time it returns;
- ``shared_system``: more distinct system prompts than fit, each reused by later requests after
  the others went through;
- ``no_hit``: unique prompts only (nothing can hit: the tier's cost, its offloads, with no gain).

Each runs ``--repeats`` times per setting, off and on alternating on fresh engines (medians
reported), closed-loop at ``--concurrency`` through the engine's step loop (a request is added
when one finishes): TTFT is add to first token, on the same clock for both. Reported per workload
and setting: host-tier hit rate (tokens found in the tier / tokens looked up there), prefix hit
rate (all tiers), TTFT p50/p99, prompt tokens computed (not served from a cache), tokens per
second (prompt + generated), blocks copied each way; and ``ratios``, tier on over off.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quire_engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from quire_engine.engine.llm import LLM

WORKLOADS = ("multi_turn", "shared_system", "no_hit")
# A conversation or a request: (key, prompt builder input) resolved into token ids as it runs.
Prompt = list[int]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default=None,
        help="bench throughput's preset model (e.g. 32m, a 32.5M Llama); default: the embedded "
        "tiny model",
    )
    parser.add_argument("--num-blocks", type=int, default=96, help="the device pool, in blocks")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--tier-x",
        type=float,
        default=8.0,
        help="the host tier's size as a multiple of the device pool's bytes",
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=96, help="new user tokens per turn")
    parser.add_argument("--systems", type=int, default=16, help="distinct system prompts")
    parser.add_argument("--system-tokens", type=int, default=320)
    parser.add_argument("--uses", type=int, default=3, help="requests per system prompt")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per setting, off and on alternating, each on a fresh engine; medians reported",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    workloads = args.workloads.split(",")
    out: dict[str, Any] = {"device_pool_blocks": args.num_blocks, "block_size": args.block_size}
    with tempfile.TemporaryDirectory() as tmp:
        model = preset_model_path(args, Path(tmp))
        for name in workloads:
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(args.repeats):  # alternating, so slow drifts of the machine hit both
                for tier in (False, True):
                    with _llm(model, args, tier) as llm:
                        host = llm.engine.scheduler.kv.host
                        if host is not None:
                            out["tier_blocks"] = host.num_blocks
                        runs[tier].append(_drive(llm, name, args))
            results: dict[str, Any] = {
                "tier_off": _median(runs[False]),
                "tier_on": _median(runs[True]),
            }
            on, off = results["tier_on"], results["tier_off"]
            results["ratios"] = {
                "ttft_p50_on_over_off": _ratio(on["ttft_p50_ms"], off["ttft_p50_ms"]),
                "ttft_p99_on_over_off": _ratio(on["ttft_p99_ms"], off["ttft_p99_ms"]),
                "prompt_tokens_computed_on_over_off": _ratio(
                    on["prompt_tokens_computed"], off["prompt_tokens_computed"]
                ),
                "tokens_per_s_on_over_off": _ratio(on["tokens_per_s"], off["tokens_per_s"]),
            }
            out[name] = results
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (the counts are the same in every run)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def preset_model_path(args: argparse.Namespace, tmp: Path) -> str:
    if args.preset is None:
        return "tiny"
    from quire_engine.bench import throughput
    from quire_engine.model.tiny_model import build_tokenizer

    targs = throughput.parse(["--preset", args.preset, "--device", "cpu"])
    path = tmp / "model"
    throughput.bench_model(targs).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _llm(model: str, args: argparse.Namespace, tier: bool) -> LLM:
    """A fresh engine on ``--num-blocks`` device blocks; with ``tier``, a host tier of
    ``--tier-x`` times the device pool's bytes (the pool's block bytes read from an engine
    built without one)."""
    from quire_engine.engine.llm import LLM

    engine: dict[str, Any] = {
        "device": "cpu",
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "max_model_len": min(args.num_blocks * args.block_size, 2048),
        "max_num_seqs": args.concurrency,
        "seed": args.seed,
        "threads": 1,
    }
    llm = LLM(model, **engine)
    if not tier:
        return llm
    bytes_per_block = llm.engine.runner.shape.bytes_per_block
    llm.close()
    size = args.tier_x * args.num_blocks * bytes_per_block / 2**30
    return LLM(model, **engine, kv_offloading_size=size)


class _Source:
    """The workload's requests, issued in order; a multi-turn conversation's next turn is built
    from its previous prompt and answer when that turn comes up."""

    def __init__(self, name: str, args: argparse.Namespace, vocab: int) -> None:
        rng = random.Random(args.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, vocab) for _ in range(n)]

        self.history: dict[int, list[int]] = {}
        self.plan: list[tuple[int | None, list[int]]] = []  # (conversation, new tokens)
        if name == "multi_turn":
            for _ in range(args.turns):
                self.plan += [(c, tokens(args.turn_tokens)) for c in range(args.conversations)]
        elif name == "shared_system":
            systems = [tokens(args.system_tokens) for _ in range(args.systems)]
            for _ in range(args.uses):
                self.plan += [(None, s + tokens(32)) for s in systems]
        else:
            n = args.conversations * args.turns
            self.plan = [(None, tokens(args.system_tokens)) for _ in range(n)]
        self.next = 0

    def take(self) -> tuple[int | None, list[int]] | None:
        if self.next == len(self.plan):
            return None
        conv, new = self.plan[self.next]
        self.next += 1
        if conv is None:
            return None, new
        return conv, self.history.get(conv, []) + new

    def answered(self, conv: int | None, prompt: list[int], output: list[int]) -> None:
        if conv is not None:
            self.history[conv] = prompt + output


def _drive(llm: LLM, name: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = llm.engine
    source = _Source(name, args, min(engine.vocab_size, 4000))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    live: dict[str, tuple[int | None, list[int], float]] = {}
    ttft: list[float] = []
    first_seen: set[str] = set()
    prompt_tokens = cached = generated = 0
    ids = 0
    started = time.perf_counter()
    while True:
        while len(live) < args.concurrency:
            item = source.take()
            if item is None:
                break
            conv, prompt = item
            rid = f"r{ids}"
            ids += 1
            engine.add_request(rid, prompt, params)
            live[rid] = (conv, prompt, time.perf_counter())
        if not live:
            break
        for output in engine.step():
            conv, prompt, added = live[output.request_id]
            if output.request_id not in first_seen and output.outputs[0].token_ids:
                first_seen.add(output.request_id)
                ttft.append(time.perf_counter() - added)
            if output.finished:
                del live[output.request_id]
                tokens = list(output.outputs[0].token_ids)
                prompt_tokens += len(prompt)
                cached += max(output.num_cached_tokens, 0)
                generated += len(tokens)
                source.answered(conv, prompt, tokens)
    elapsed = time.perf_counter() - started
    stats = engine.scheduler.stats()
    host = stats.host
    ttft_ms = sorted(t * 1000 for t in ttft)
    return {
        "requests": ids,
        "host_hit_rate": round(host.hits / host.queries, 4) if host and host.queries else 0.0,
        "prefix_hit_rate": round(stats.prefix_hits / stats.prefix_queries, 4),
        "ttft_p50_ms": round(statistics.median(ttft_ms), 2),
        "ttft_p99_ms": round(ttft_ms[min(len(ttft_ms) - 1, int(0.99 * len(ttft_ms)))], 2),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": prompt_tokens - cached,
        "tokens_per_s": round((prompt_tokens + generated) / elapsed, 1),
        "seconds": round(elapsed, 2),
        "blocks_offloaded": host.offloaded if host else 0,
        "blocks_loaded": host.loaded if host else 0,
    }
