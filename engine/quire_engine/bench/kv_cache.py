"""The KV cache formats side by side (``--kv-cache-dtype``), in one run: what the same KV memory
holds, how fast a workload limited by that memory runs, and, given a real checkpoint, what the
8-bit formats cost in accuracy.

- ``capacity``: blocks and tokens each format gets from the same ``kv_cache_memory`` (the
  engine's own sizing: data bytes plus the float32 scales), for the benchmark Llama's shape
  (head_dim 64) at float32 and, computed from the same rule, at bfloat16.
- ``throughput`` (``bench throughput``'s workload and model, a KV budget that holds fewer
  sequences than are waiting): tok/s, the most sequences running in one step, preemptions.
- ``accuracy`` (``--model``, a real checkpoint, and ``--text``): perplexity of the text under
  each format (every position's log-probability read from the prompt logprobs of one prefill,
  which reads K/V back from the pool like a decode does) and the mean KL divergence
  ``KL(P_auto || P_format)`` over the text's positions, from the full next-token distributions.

The decode kernel's time per token by format is ``bench kernel``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quire_engine.bench import throughput
from quire_engine.core.config import KVCacheDtype
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.model.cache_shape import CacheShape

if TYPE_CHECKING:
    from quire_engine.engine.llm import LLM

FORMATS = (KVCacheDtype.AUTO, KVCacheDtype.INT8, KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    throughput.add_arguments(parser)
    parser.set_defaults(preset="32m", budget_seqs=4, num_requests=48)
    parser.add_argument(
        "--formats",
        default=",".join(f.value for f in FORMATS),
        help="comma-separated --kv-cache-dtype values to compare (the first is the baseline)",
    )
    parser.add_argument(
        "--parts", default="capacity,throughput", help="capacity, throughput, accuracy"
    )
    parser.add_argument("--model", default=None, help="a real checkpoint, for accuracy")
    parser.add_argument("--text", default=None, help="a text file, for accuracy's perplexity")


def run(args: argparse.Namespace) -> dict[str, Any]:
    formats = [KVCacheDtype(f).canonical for f in args.formats.split(",")]
    parts = set(args.parts.split(","))
    model_path, text = args.model, args.text
    args = throughput.parse(_argv(args))  # the throughput workload's arguments, preset applied
    out: dict[str, Any] = {"formats": [f.value for f in formats]}
    if "capacity" in parts or "throughput" in parts:
        model = throughput.bench_model(args)
        budget_bytes = _shape(model, args, KVCacheDtype.AUTO).bytes_per_token * (
            args.budget_seqs * args.max_model_len
        )
        with tempfile.TemporaryDirectory() as tmp:
            if "capacity" in parts:
                out["capacity"] = capacity(model, Path(tmp), budget_bytes, formats, args)
            if "throughput" in parts:
                out["throughput"] = kv_limited_throughput(
                    model, Path(tmp), budget_bytes, formats, args
                )
    if "accuracy" in parts:
        if model_path is None or text is None:
            raise ValueError("accuracy needs --model (a real checkpoint) and --text")
        out["accuracy"] = accuracy(model_path, Path(text).read_text(), formats)
    return out


def _argv(args: argparse.Namespace) -> list[str]:
    """``args`` back into ``bench throughput`` flags (its parser applies the preset)."""
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    argv = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value is None or value is False:
            continue
        argv += [action.option_strings[0]] + ([] if value is True else [str(value)])
    return argv


def _shape(model: Any, args: argparse.Namespace, kv: KVCacheDtype) -> CacheShape:
    return CacheShape.of(model, args.block_size, getattr(torch, args.dtype), None, kv)


@contextlib.contextmanager
def _llm(
    model: Any, tmp: Path, budget_bytes: int, kv: KVCacheDtype, args: argparse.Namespace
) -> Iterator[LLM]:
    llm = throughput.quire_llm(model, tmp, args.budget_seqs * args.max_model_len, args)
    llm.close()  # saved the checkpoint; rebuilt below with this format's pool
    from quire_engine.engine.llm import LLM

    with LLM(
        str(tmp / "model"),
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=budget_bytes,
        kv_cache_dtype=kv.value,
        max_model_len=args.max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        threads=args.threads,
    ) as built:
        yield built


def capacity(
    model: Any, tmp: Path, budget_bytes: int, formats: list[KVCacheDtype], args: argparse.Namespace
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for kv in formats:
        with _llm(model, tmp, budget_bytes, kv, args) as llm:
            blocks = llm.engine.scheduler.kv.num_blocks
            per_token = llm.engine.runner.shape.bytes_per_token
        rows[kv.value] = {
            "blocks": blocks,
            "tokens": blocks * args.block_size,
            "bytes_per_token": per_token,
        }
    base = rows[formats[0].value]["tokens"]
    for row in rows.values():
        row["tokens_vs_baseline"] = round(row["tokens"] / base, 3)
    bf16 = _shape(model, argparse.Namespace(**{**vars(args), "dtype": "bfloat16"}), formats[0])
    return {
        "kv_cache_memory": budget_bytes,
        "head_dim": _shape(model, args, formats[0]).head_dim,
        "by_format": rows,
        # What bf16 K/V would hold in the same memory (the same sizing rule).
        "bfloat16_tokens": budget_bytes // bf16.bytes_per_block * args.block_size,
    }


def kv_limited_throughput(
    model: Any, tmp: Path, budget_bytes: int, formats: list[KVCacheDtype], args: argparse.Namespace
) -> dict[str, Any]:
    lengths, prompts = throughput.workload(args)
    params = throughput.request_params(lengths)
    rows: dict[str, Any] = {}
    for kv in formats:
        with _llm(model, tmp, budget_bytes, kv, args) as llm:
            sched = llm.engine.scheduler
            most = _MostRunning()
            llm.engine.add_observer(most)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            rows[kv.value] = {
                "tok_s": round(produced / wall, 1),
                "max_running": most.value,
                "preemptions": sum(sched.num_preemptions.values()),
                "pool_blocks": sched.kv.num_blocks,
            }
    base = rows[formats[0].value]["tok_s"]
    for row in rows.values():
        row["tok_s_vs_baseline"] = round(row["tok_s"] / base, 3)
    return {"requests": len(prompts), "waiting_at_start": len(prompts), "by_format": rows}


class _MostRunning:
    """A step observer keeping the largest number of sequences one step ran."""

    def __init__(self) -> None:
        self.value = 0

    def on_step(self, step: Any) -> None:
        self.value = max(self.value, len(step.schedule.seqs))


def accuracy(model: str, text: str, formats: list[KVCacheDtype]) -> dict[str, Any]:
    """Perplexity of ``text`` and KL divergence from the first format, per format."""
    from quire_engine.engine.llm import LLM

    logits: dict[str, torch.Tensor] = {}
    rows: dict[str, Any] = {}
    for kv in formats:
        with LLM(
            model, device="cpu", kv_cache_dtype=kv.value, max_model_len=2048,
            max_num_batched_tokens=2048, kv_cache_memory=256 << 20,
        ) as llm:  # fmt: skip
            ids = llm.engine.tokenizer(text)["input_ids"]
            captured = _capture_logits(llm)
            out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert out.prompt_logprobs is not None
        nll = [
            -_logprob(entry, tok)
            for entry, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)
        ]
        # The prefill's rows: the sampled one, then one per prompt position 0..n-2 (predicting
        # tokens 1..n-1), checked against the prompt logprobs the engine returned.
        logits[kv.value] = captured[0][-len(ids) + 1 :].log_softmax(-1)
        picked = logits[kv.value].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        if not torch.allclose(picked, -torch.tensor(nll), atol=1e-4):
            raise RuntimeError("the captured logits are not the prompt's positions")
        rows[kv.value] = {"perplexity": round(math.exp(sum(nll) / len(nll)), 4)}
    base = formats[0].value
    for kv in formats:
        p, q = logits[base], logits[kv.value]
        kl = (p.exp() * (p - q)).sum(-1)  # [positions]
        rows[kv.value] |= {
            "ppl_vs_baseline": round(rows[kv.value]["perplexity"] / rows[base]["perplexity"], 5),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
        }
    return {"tokens": len(ids), "by_format": rows}


def _capture_logits(llm: LLM) -> list[torch.Tensor]:
    """Every step's logits from now on (the runner's ``execute`` results), in order."""
    captured: list[torch.Tensor] = []
    execute = llm.engine.runner.execute

    def capture(*args: Any, **kwargs: Any) -> torch.Tensor:
        result = execute(*args, **kwargs)
        captured.append(result)
        return result

    llm.engine.runner.execute = capture  # type: ignore[method-assign]
    return captured


def _logprob(entry: dict[int, float] | None, token: int) -> float:
    if entry is None:
        raise RuntimeError("a prompt position came back without its logprob")
    return entry[token]
