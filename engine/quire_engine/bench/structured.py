"""Structured outputs: constrained against unconstrained throughput at the same batch and load,
grammar compile time over a set of schemas, and the time-to-first-token cost of a first-seen
schema.

Throughput: ``--batch`` requests of ``--output`` tokens each, sampled (temperature 1, fixed
seeds), run twice on one engine, unconstrained and then constrained by a regex that never ends
(printable ASCII); ``min_tokens`` equal to ``max_tokens`` holds both runs to exactly the same
work. Compile: ``--schemas`` distinct JSON schemas (objects of 2..12 typed, nested properties),
each compiled once through the engine's grammar cache (all misses). First-seen TTFT: one
request added and stepped to its first token, with a new schema (compile included, as the
server does before queuing) and again with the same, now cached, schema.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from quire_engine.core.config import EngineConfig
from quire_engine.core.constraint import ConstraintKind, OutputConstraint
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm_engine import LLMEngine

_TYPES = ["string", "integer", "number", "boolean"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)


def schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for k in range(rng.randrange(2, 13)):
        kind = rng.choice(_TYPES + (["object", "array"] if depth < 2 else []))
        if kind == "object":
            props[f"f{k}"] = schema(rng, depth + 1)
        elif kind == "array":
            props[f"f{k}"] = {"type": "array", "items": {"type": rng.choice(_TYPES)}}
        else:
            props[f"f{k}"] = {"type": kind}
    return {"type": "object", "properties": props, "required": sorted(props)}


def _throughput(engine: LLMEngine, args: argparse.Namespace, constraint: Any) -> float:
    """Generated tokens per second of one batch."""
    for i in range(args.batch):
        params = SamplingParams(
            max_tokens=args.output,
            min_tokens=args.output,
            seed=args.seed + i,
            constraint=constraint,
        )
        engine.add_request(f"{'c' if constraint else 'u'}{i}", "Write:", params)
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens += sum(len(s.token_ids) for s in out.outputs)
    return tokens / (time.perf_counter() - start)


def _ttft(engine: LLMEngine, constraint: OutputConstraint, rid: str) -> float:
    """Seconds from compile (a cache hit when seen) to the request's first token."""
    start = time.perf_counter()
    engine.grammars.compile(constraint)
    engine.add_request(rid, "Write:", SamplingParams(max_tokens=1, constraint=constraint))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig.from_flat(model=args.model, device=args.device))
    never_ends = OutputConstraint(ConstraintKind.REGEX, "[ -~]*")
    _throughput(engine, argparse.Namespace(**{**vars(args), "batch": 4}), never_ends)  # warm-up
    free = _throughput(engine, args, None)
    constrained = _throughput(engine, args, never_ends)

    rng = random.Random(args.seed)
    compiles = []
    for _ in range(args.schemas):
        c = OutputConstraint(ConstraintKind.JSON, json.dumps(schema(rng)))
        t0 = time.perf_counter()
        engine.grammars.compile(c)
        compiles.append(time.perf_counter() - t0)
    compiles.sort()
    first, again = [], []
    for k in range(5):
        c = OutputConstraint(ConstraintKind.JSON, json.dumps(schema(rng)))
        first.append(_ttft(engine, c, f"first{k}"))
        again.append(_ttft(engine, c, f"again{k}"))
    ms = 1000.0
    return {
        "model": engine.model_name,
        "device": str(engine.device),
        "batch": args.batch,
        "output_tokens": args.output,
        "unconstrained_tok_s": round(free, 1),
        "constrained_tok_s": round(constrained, 1),
        "constrained_ratio": round(constrained / free, 3),
        "schemas": args.schemas,
        "compile_ms_p50": round(statistics.median(compiles) * ms, 2),
        "compile_ms_p99": round(compiles[int(0.99 * (len(compiles) - 1))] * ms, 2),
        "ttft_ms_first_seen_schema": round(statistics.median(first) * ms, 2),
        "ttft_ms_cached_schema": round(statistics.median(again) * ms, 2),
    }
