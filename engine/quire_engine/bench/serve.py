"""Online serving benchmark against a running OpenAI-compatible server (``quire-engine serve`` or
any other), in the manner of vLLM's ``bench serve``.

Requests go to ``/v1/completions`` as token-id prompts (so prompt lengths are exact whatever the
tokenizer) with ShareGPT-like log-normal lengths (``bench.workload``), greedy, ``ignore_eos`` (so
each request generates exactly its sampled output length), streamed with usage. They are sent
with Poisson arrivals at ``--request-rate`` (``inf``: all at once), optionally capped at
``--max-concurrency`` in flight.

Per request, measured on the client: TTFT (send -> first streamed chunk), ITL (gaps between
chunks), TPOT ((e2e - TTFT) / (output tokens - 1)), e2e (send -> ``[DONE]``). Output token counts
come from the server's usage chunk. A request fails on a non-200 status, an error event, a
transport error or a missing usage chunk.

ITL is per streamed chunk, as in vLLM: a token that completes no character (part of a UTF-8
sequence, frequent in the embedded model's random bytes) is sent with the next one, so its gap
merges into the next. TPOT counts tokens and is unaffected.

Peers in one command: ``--launch quire,transformers`` starts each server itself (``bench.servers``:
one model directory, the same KV budget, one torch thread each), runs the same requests against
it, and stops it; ``--offline`` runs the same requests through the offline ``LLM`` with
``max_num_seqs`` equal to ``--max-concurrency``. The report then holds one section per system and
the ratios: Quire's output throughput over the offline one (the serving path's cost) and over
``transformers serve --continuous-batching``. With transformers among the systems the prompts are
text (random printable ASCII, one byte token each after the BOS; transformers serve takes only
text prompts and refuses ``ignore_eos``, which its model needs not: the benchmark model has no
EOS).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2

from quire_engine.bench import peers as servers
from quire_engine.bench.client import (
    RequestResult,
    latency_summary,
    model_card,
    scrape,
    stream_completion,
)
from quire_engine.bench.workload import (
    RequestLengths,
    random_tokens,
    sharegpt_like,
    warm_up_prompts,
)

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from quire_engine.bench import roofline  # imports torch: the client side does not need it

MAX_ERRORS_REPORTED = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    parser.add_argument("--mean-prompt-len", type=float, default=200.0)
    parser.add_argument("--mean-output-len", type=float, default=180.0)
    parser.add_argument("--sigma", type=float, default=0.9, help="log-normal shape (tail)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="prompt token ids are drawn below this (256 suits the embedded byte tokenizer)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("QUIRE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer token [env QUIRE_API_KEY or OPENAI_API_KEY]",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--launch",
        default=None,
        help="comma-separated servers to start and measure in turn, instead of --url "
        f"({', '.join(servers.SYSTEMS)})",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="also run the same requests through the offline LLM at --max-concurrency",
    )
    parser.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default=None,
        help="token-id or text prompts (default: ids; text when transformers is launched)",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="model for --launch/--offline (default: the benchmark Llama, built in a temp dir)",
    )
    parser.add_argument("--hidden-size", type=int, default=512, help="benchmark Llama")
    parser.add_argument("--layers", type=int, default=6, help="benchmark Llama (9: 32.5M)")
    parser.add_argument("--model-vocab-size", type=int, default=4096, help="benchmark Llama")
    parser.add_argument("--max-model-len", type=int, default=1024, help="for --launch/--offline")
    parser.add_argument(
        "--kv-budget", type=int, default=8192, help="KV tokens of every launched system"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="split the Quire server's CPU: its engine steps by phase (launched with serve "
        "--profile; with --url the server must run with --profile) and the rest of the "
        "process (HTTP, SSE, tokenization)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1; got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"request_rate must be > 0; got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1; got {args.max_concurrency}")
    if args.launch is None and not args.offline:
        return asyncio.run(_bench(args, args.url, None))
    return _compare(args)


@dataclass(frozen=True, slots=True)
class _Workload:
    """The requests: lengths, prompts (token ids or text) and whether to send ``ignore_eos``."""

    lengths: list[RequestLengths]
    prompts: list[list[int] | str]
    ignore_eos: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace, max_model_len: int) -> _Workload:
        lengths = sharegpt_like(
            args.num_prompts,
            mean_prompt=args.mean_prompt_len,
            mean_output=args.mean_output_len,
            sigma=args.sigma,
            max_model_len=max_model_len,
            seed=args.seed,
        )
        rng = random.Random(args.seed)
        if args.prompt_format == "text":
            # Printable ASCII: one byte token per character, plus the BOS the tokenizer adds.
            text: list[list[int] | str] = [
                "".join(chr(rng.randrange(32, 127)) for _ in range(max(1, r.prompt - 1)))
                for r in lengths
            ]
            return cls(lengths, text, ignore_eos=False)
        ids: list[list[int] | str] = [
            random_tokens(rng, r.prompt, args.vocab_size) for r in lengths
        ]
        return cls(lengths, ids, ignore_eos=True)


def _compare(args: argparse.Namespace) -> dict[str, Any]:
    """Launch each server in turn (and the offline run) on one model; one report with ratios."""
    systems = [s for s in (args.launch or "").split(",") if s]
    unknown = set(systems) - set(servers.SYSTEMS)
    if unknown:
        raise ValueError(f"unknown --launch {sorted(unknown)}; choose from {servers.SYSTEMS}")
    if args.prompt_format is None:
        args.prompt_format = "text" if "transformers" in systems else "ids"
    if "transformers" in systems and args.prompt_format != "text":
        raise ValueError("transformers serve takes only text prompts: use --prompt-format text")
    workload = _Workload.from_args(args, args.max_model_len)
    result: dict[str, Any] = {
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "kv_budget_tokens": args.kv_budget,
        "prompt_format": args.prompt_format,
        "output_tokens": sum(r.output for r in workload.lengths),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else None
        if model_dir is None:
            model_dir = servers.build_model_dir(
                Path(tmp) / "model",
                hidden=args.hidden_size,
                layers=args.layers,
                vocab=args.model_vocab_size,
                max_model_len=args.max_model_len,
                seed=args.seed,
            )
        spec = servers.ServerSpec(
            model_dir=model_dir,
            kv_budget=args.kv_budget,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_batch_tokens=args.max_batch_tokens,
            dtype="float32",
            profile=args.profile,
        )
        for system in systems:
            log = Path(tmp) / f"{system}.log"
            with servers.launched(system, spec, log) as server:
                args.model = str(model_dir)
                result[system] = asyncio.run(
                    _bench(args, server.url, workload, warm_up=True, cpu=server.cpu_seconds)
                )
        if args.offline:
            result["offline"], steps, machine = _offline(spec, workload, args.max_concurrency)
            result["floor"] = _floor(result, steps, machine)
    _ratios(result)
    return result


def _floor(
    result: dict[str, Any], log: roofline.StepLog, machine: roofline.Rates
) -> dict[str, Any]:
    """The roofline of the offline run's steps (``bench.roofline``): at the same concurrency
    the servers run about the same schedule, so each server's duration over this floor says how
    far it is from this machine's limit, and transformers' duration over it bounds the ratio any
    engine could reach over ``transformers serve`` here (``max_ratio_vs_transformers``)."""
    from quire_engine.bench import roofline

    offline = result["offline"]
    servers_s = {name: result[name]["duration_s"] for name in servers.SYSTEMS if name in result}
    floor = roofline.report(
        log,
        machine,
        tokens=offline["total_output_tokens"],
        wall_s=offline["duration_s"],
        peers_wall_s={name: s for name, s in servers_s.items() if name != "quire"},
    )
    for name, seconds in servers_s.items():
        floor[f"{name}_vs_floor"] = round(seconds / floor["floor_s"], 2)
    return floor


def _offline(
    spec: servers.ServerSpec, workload: _Workload, concurrency: int | None
) -> tuple[dict[str, Any], roofline.StepLog, roofline.Rates]:
    """The same requests through ``LLM.generate`` in this process, one torch thread: the
    report, the run's steps and the machine's rates (the faster of before and after it)."""
    import torch

    from quire_engine.bench import roofline
    from quire_engine.core.sampling_params import SamplingParams
    from quire_engine.engine.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(
        str(spec.model_dir),
        device="cpu",
        dtype=spec.dtype,
        block_size=spec.block_size,
        num_blocks=spec.kv_budget // spec.block_size,
        max_model_len=spec.max_model_len,
        max_num_seqs=concurrency or 256,
        max_num_batched_tokens=spec.max_batch_tokens,
        threads=1,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output, ignore_eos=workload.ignore_eos)
        for r in workload.lengths
    ]
    warm = warm_up_prompts(workload.prompts, 2)
    llm.generate(warm, [SamplingParams(temperature=0.0, max_tokens=2)] * len(warm))
    before = roofline.Rates.for_model(llm.engine.runner.model)
    log = roofline.StepLog()
    with log.attach(llm.engine):
        start, cpu_start = time.perf_counter(), time.process_time()
        outs = llm.generate(list(workload.prompts), params)
        duration, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    report = {
        "duration_s": round(duration, 3),
        "total_output_tokens": produced,
        "output_throughput": round(produced / duration, 2),
        "cpu_s": round(cpu_s, 2),
        "output_tokens_per_cpu_s": round(produced / cpu_s, 2),
    }
    after = roofline.Rates.for_model(llm.engine.runner.model)
    return report, log, roofline.Rates.fastest(before, after)


def _ratios(result: dict[str, Any]) -> None:
    quire = result.get("quire")
    if quire is None:
        return
    for peer, key in (("offline", "ratio_vs_offline"), ("transformers", "ratio_vs_transformers")):
        other = result.get(peer)
        if other and other.get("output_throughput"):
            result[key] = round(quire["output_throughput"] / other["output_throughput"], 3)
        # Per CPU second: robust to other processes' load on a shared machine.
        if other and other.get("output_tokens_per_cpu_s") and quire.get("output_tokens_per_cpu_s"):
            ratio = quire["output_tokens_per_cpu_s"] / other["output_tokens_per_cpu_s"]
            result[f"{key}_per_cpu_s"] = round(ratio, 3)


async def _bench(
    args: argparse.Namespace,
    url: str,
    workload: _Workload | None,
    *,
    warm_up: bool = False,
    cpu: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Run the workload (None: built for the server's max_model_len) against ``url``; ``cpu``
    reads the server's CPU seconds, to report output tokens per server CPU second."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # One connection per request in flight, as real clients behave; no pool limit of our own.
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(args.timeout, connect=30.0)
    async with httpx2.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, limits=limits, timeout=timeout
    ) as client:
        model, max_model_len = await model_card(client, args.model)
        if workload is None:
            workload = _Workload.from_args(args, max_model_len)
        if warm_up:  # first-request costs (transformers builds its batching manager) excluded
            prompt = warm_up_prompts(workload.prompts, 1)[0]  # no prefix shared with the run
            warm = RequestLengths(prompt=len(prompt), output=4)
            await stream_completion(client, model, prompt, warm, None, workload.ignore_eos)
        rng = random.Random(args.seed + 1)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        scraped = await scrape(client)
        profile_start = _profile_counters(scraped) if args.profile else None
        gc_start = _gc_pauses(scraped)
        cpu_start = cpu() if cpu is not None else None
        start = time.perf_counter()
        tasks = []
        for prompt, length in zip(workload.prompts, workload.lengths, strict=True):
            tasks.append(
                asyncio.create_task(
                    stream_completion(client, model, prompt, length, gate, workload.ignore_eos)
                )
            )
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu_s = cpu() - cpu_start if cpu is not None and cpu_start is not None else None
        scraped = await scrape(client) if scraped else []
        profile_end = _profile_counters(scraped) if profile_start is not None else None
        gc_end = _gc_pauses(scraped) if gc_start is not None else None
    report = _report(args, url, model, results, duration)
    if gc_start is not None and gc_end is not None:
        report["server_gc_pauses"] = {
            gen: {k: round(v - gc_start.get(gen, {}).get(k, 0.0), 4) for k, v in stats.items()}
            for gen, stats in gc_end.items()
        }
    if cpu_s:
        report["server_cpu_s"] = round(cpu_s, 2)
        report["output_tokens_per_cpu_s"] = round(report["total_output_tokens"] / cpu_s, 2)
    if profile_start is not None and profile_end is not None:
        report["profile"] = _profile_report(profile_start, profile_end, cpu_s)
    return report


def _profile_counters(families: list[Metric]) -> dict[str, float] | None:
    """``quire_profile_*`` counters (phase -> CPU seconds, plus "steps"), or None when the server
    exports none (not Quire, or not started with ``--profile``)."""
    found: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == "quire_profile_step_cpu_seconds_total":
                found[sample.labels["phase"]] = sample.value
            elif sample.name == "quire_profile_steps_total":
                found["steps"] = sample.value
    return found or None


def _gc_pauses(families: list[Metric]) -> dict[str, dict[str, float]] | None:
    """The server's garbage-collector pauses so far, by generation (``count``, ``sum_s`` and
    ``over_50ms``, from ``quire_gc_pause_seconds``), or None when it exports none."""
    found: dict[str, dict[str, float]] = {}
    for family in families:
        if family.name != "quire_gc_pause_seconds":
            continue
        for sample in family.samples:
            stats = found.setdefault(sample.labels["generation"], {})
            if sample.name.endswith("_count"):
                stats["count"] = sample.value
            elif sample.name.endswith("_sum"):
                stats["sum_s"] = sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == 0.05:
                stats["within_50ms"] = sample.value
    for stats in found.values():
        stats["over_50ms"] = stats.get("count", 0.0) - stats.pop("within_50ms", 0.0)
    return found or None


def _profile_report(
    start: dict[str, float], end: dict[str, float], server_cpu_s: float | None
) -> dict[str, Any]:
    """The engine steps' split over the run, and the server CPU spent outside them."""
    from quire_engine.engine.profile import split_report

    phases = {k: end[k] - start.get(k, 0.0) for k in end if k != "steps"}
    report = split_report(int(end.get("steps", 0) - start.get("steps", 0)), phases)
    if server_cpu_s is not None:
        # The event loop (HTTP, JSON, SSE), tokenization threads and the engine thread between
        # steps: what serving adds on top of the engine's own work.
        report["server_cpu_outside_steps_s"] = round(server_cpu_s - sum(phases.values()), 3)
    return report


def _report(
    args: argparse.Namespace, url: str, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)
        for r in done
        if r.e2e is not None and r.ttft is not None and r.output_tokens > 1
    ]
    report: dict[str, Any] = {
        "url": url,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "completed": len(done),
        "failed": len(failed),
        "duration_s": round(duration, 3),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 2),
    }
    report.update(latency_summary("ttft", [r.ttft for r in done if r.ttft is not None]))
    report.update(latency_summary("tpot", tpots))
    report.update(latency_summary("itl", [gap for r in done for gap in r.itls]))
    report.update(latency_summary("e2e", [r.e2e for r in done if r.e2e is not None]))
    report["errors"] = [r.error for r in failed[:MAX_ERRORS_REPORTED]]
    return report
