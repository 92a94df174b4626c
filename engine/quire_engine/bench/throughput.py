"""Offline throughput at one KV budget: Quire vs transformers' static batching and transformers'
continuous batching, same weights, same requests, measured in one run.

The workload: ShareGPT-like log-normal prompt and output lengths (fixed seed), token-id prompts,
greedy decoding with EOS ignored so every system generates exactly the requested lengths. The KV
budget is ``--budget-seqs`` contiguous ``max_model_len`` sequences, in tokens:

* Quire: a paged pool of ``budget / block_size`` blocks.
* HF static (the naive contiguous server of the PagedAttention paper): ``generate`` on left-padded
  waves, taken in arrival order, each as large as the budget allows when every sequence reserves
  the wave's padded prompt plus its ``max_new_tokens``. Tokens generated past a request's own
  length are waste and are not counted.
* HF continuous: transformers' continuous-batching manager with its paged cache held to the same
  number of tokens, per-request ``max_new_tokens``.

``--dtypes float32,bfloat16`` runs all of it once per dtype on the same weights (cast) and
requests and reports each system's bf16-over-fp32 speed ratio (``dtype_ratios``).

Throughput = requested output tokens / wall time, and per CPU second of the process (the
``_per_cpu_s`` keys: every system runs one torch thread, so this is robust to other processes'
load on a shared machine). On CPU the ``floor`` section (``bench.roofline``) puts Quire's steps
at this machine's measured read bandwidth and GEMM rate: the least time any engine running them
could take here, and so the largest ratio over each peer that any engine could reach. The model
is a Llama built from a config with random weights (the cost of a forward pass does not depend
on the values).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from quire_engine.bench import roofline
from quire_engine.bench.hf_batching import Rate, hf_continuous, hf_static
from quire_engine.bench.workload import RequestLengths, sharegpt_like, warm_up_prompts
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.model.tiny_model import build_tokenizer

if TYPE_CHECKING:
    from quire_engine.engine.llm import LLM

# Named workloads: flag defaults they override (explicit flags still win).
PRESETS: dict[str, dict[str, Any]] = {
    # The workload of issue 14: a 32.5M-parameter Llama (9 layers), 64 requests, a KV budget
    # of 12 x 1024 = 12,288 tokens.
    "32m": {"layers": 9, "budget_seqs": 12},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named workload (32m: 32.5M-parameter Llama, 12,288-token KV budget)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also split Quire's step time (matmuls, attention, rest of the forward, per-step "
        "Python) in a second, hooked run; throughput is from the plain run",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--mean-prompt", type=float, default=128)
    parser.add_argument("--mean-output", type=float, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--budget-seqs",
        type=int,
        default=None,
        help="KV budget = this many contiguous max_model_len sequences (default 8)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None, help="default 6")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--systems", default="quire,hf_static,hf_continuous", help="comma-separated subset to run"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run Quire sharded over this many ranks (one worker process each, --threads "
        "threads per rank on CPU) and report its speed-up over one rank and the collectives' "
        "share of its wall time",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="float32 on CPU, bfloat16 on CUDA")
    parser.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated dtypes (e.g. float32,bfloat16): run the systems at each, on the "
        "same weights and requests, and report each later dtype's speed over the first's "
        "(overrides --dtype)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for every system (on a small shared machine one thread each "
        "keeps OpenMP barriers from turning other processes' load into 2x swings)",
    )


def bench_config(args: argparse.Namespace) -> LlamaConfig:
    return llama_config(args.hidden_size, args.layers, args.vocab_size, args.max_model_len)


def bench_model(args: argparse.Namespace) -> PreTrainedModel:
    """The benchmark Llama with random weights on ``args.device``, in ``args.dtype`` (``auto``
    is resolved here, in ``args``: float32 on CPU, bfloat16 on CUDA)."""
    device = torch.device(args.device)
    if args.dtype == "auto":
        args.dtype = "float32" if device.type == "cpu" else "bfloat16"
    model = LlamaForCausalLM(bench_config(args)).eval()
    return model.to(device=device, dtype=getattr(torch, args.dtype))


def llama_config(hidden: int, layers: int, vocab: int, max_model_len: int) -> LlamaConfig:
    """The benchmark Llama: ~23M parameters at hidden 512, 6 layers, vocab 4096 (32.5M at 9
    layers): big enough that matmuls, not Python, dominate a step on 2 CPU cores, small enough
    that three systems finish in minutes. No EOS, so every request runs to its max_tokens."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        max_position_embeddings=max_model_len,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def _apply_preset(args: argparse.Namespace) -> None:
    values = {"layers": 6, "budget_seqs": 8}
    if args.preset is not None:
        values.update(PRESETS[args.preset])
    for name, value in values.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def workload(args: argparse.Namespace) -> tuple[list[RequestLengths], list[list[int]]]:
    """The requests' lengths and token-id prompts for these (preset-applied) arguments; seeds
    torch and sets its thread count, as every run of this bench does first."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    lengths = sharegpt_like(
        args.num_requests,
        mean_prompt=args.mean_prompt,
        mean_output=args.mean_output,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(1, args.vocab_size, (r.prompt,), generator=gen).tolist() for r in lengths
    ]
    return lengths, prompts


def parse(argv: list[str]) -> argparse.Namespace:
    """This bench's arguments from ``argv`` with the preset applied (for other benchmarks that
    run its workload: ``benchmarks/native_ab.py``)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    _apply_preset(args)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    _apply_preset(args)
    if args.dtypes is not None:
        return _by_dtype(args)
    return _run_one(args)


def _by_dtype(args: argparse.Namespace) -> dict[str, Any]:
    """``--dtypes``: one run per dtype (every one seeds torch alike, so the same weights, cast,
    and the same requests), under ``by_dtype``; ``dtype_ratios`` has each system's speed at each
    later dtype over the first (``quire_bfloat16_vs_float32``: wall time ratio, the same tokens;
    ``..._per_cpu_s``: process CPU time ratio)."""
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if len(dtypes) < 1 or len(set(dtypes)) != len(dtypes):
        raise ValueError(f"--dtypes needs distinct dtypes, got {args.dtypes!r}")
    runs = {d: _run_one(argparse.Namespace(**{**vars(args), "dtype": d})) for d in dtypes}
    base, first = dtypes[0], runs[dtypes[0]]
    ratios: dict[str, float] = {}
    for other in dtypes[1:]:
        for system in args.systems.split(","):
            wall, cpu = f"{system}_tok_s", f"{system}_tok_per_cpu_s"
            if wall in first and wall in runs[other]:
                key = f"{system}_{other}_vs_{base}"
                ratios[key] = round(runs[other][wall] / first[wall], 2)
                ratios[f"{key}_per_cpu_s"] = round(runs[other][cpu] / first[cpu], 2)
    return {"dtypes": dtypes, "dtype_ratios": ratios, "by_dtype": runs}


def _run_one(args: argparse.Namespace) -> dict[str, Any]:
    lengths, prompts = workload(args)
    budget = args.budget_seqs * args.max_model_len
    device = torch.device(args.device)
    model = bench_model(args)
    systems = args.systems.split(",")
    # On CPU, the machine's rates before the runs; measured again after them for the floor of
    # Quire's steps (bench.roofline).
    floor_cpu = device.type == "cpu" and "quire" in systems
    before = roofline.Rates.for_model(model) if floor_cpu else None
    result: dict[str, Any] = {
        "num_requests": len(lengths),
        "output_tokens": sum(r.output for r in lengths),
        "prompt_tokens": sum(r.prompt for r in lengths),
        "kv_budget_tokens": budget,
        "model_params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": args.dtype,
    }
    log: roofline.StepLog | None = None  # Quire's steps
    with tempfile.TemporaryDirectory() as tmp:
        rates: dict[str, Rate] = {}
        if "quire" in systems:
            run = _quire(model, Path(tmp), prompts, lengths, budget, args)
            rates["quire"], log = run.rate, run.log
            result["quire_prefix_hit_tokens"] = run.prefix_hit_tokens
            if run.profile is not None:
                result["quire_profile"] = run.profile
            if args.tensor_parallel_size > 1:
                result["tensor_parallel"] = _tensor_parallel(
                    model, Path(tmp), prompts, lengths, budget, args, run.rate
                )
        if "hf_static" in systems:
            rates["hf_static"], result["hf_static_waves"] = hf_static(
                model, prompts, lengths, budget
            )
        if "hf_continuous" in systems:
            rates["hf_continuous"] = hf_continuous(model, prompts, lengths, budget, args)
    for name, rate in rates.items():
        result[f"{name}_tok_s"] = round(rate.tokens / rate.wall_s, 1)
        result[f"{name}_tok_per_cpu_s"] = round(rate.tokens / rate.cpu_s, 1)
    if "quire" in rates:
        quire = rates["quire"]
        peers_wall_s: dict[str, float] = {}
        for peer in ("hf_static", "hf_continuous"):
            if peer in rates:
                short = peer.removeprefix("hf_")
                ratio = rates[peer].wall_s / quire.wall_s  # same tokens: time ratio
                result[f"ratio_vs_{short}"] = round(ratio, 2)
                result[f"ratio_vs_{short}_per_cpu_s"] = round(rates[peer].cpu_s / quire.cpu_s, 2)
                peers_wall_s[short] = rates[peer].wall_s
        if before is not None and log is not None:
            # Quire's wall time over the floor (vs_floor) and, per peer, the largest ratio any
            # engine running those steps could reach here (max_ratio_vs_*).
            machine = roofline.Rates.fastest(before, roofline.Rates.for_model(model))
            result["floor"] = roofline.report(
                log, machine, tokens=quire.tokens, wall_s=quire.wall_s, peers_wall_s=peers_wall_s
            )
    return result


@dataclass(frozen=True, slots=True)
class _QuireRun:
    """Quire's timed run: its rate and steps, the prompt tokens it found in the prefix cache
    (0 on this workload of distinct random prompts, the warm-up included: what a peer without
    a prefix cache computes, Quire computes too) and the ``--profile`` run's split."""

    rate: Rate
    log: roofline.StepLog
    prefix_hit_tokens: int
    profile: dict[str, Any] | None


def _warm_up(llm: LLM, prompts: list[list[int]]) -> None:
    """Four short greedy requests on prompts that share no KV block with the workload."""
    warm = warm_up_prompts(prompts, 4)
    llm.generate(warm, [SamplingParams(temperature=0.0, max_tokens=4)] * len(warm))


def _quire(
    model: PreTrainedModel,
    tmp: Path,
    prompts: list[list[int]],
    lengths: list[RequestLengths],
    budget: int,
    args: argparse.Namespace,
) -> _QuireRun:
    from quire_engine.engine.profile import StepProfile

    llm = quire_llm(model, tmp, budget, args)
    kv = llm.engine.scheduler.kv
    params = request_params(lengths)
    _warm_up(llm, prompts)
    hits = kv.prefix_hits
    log = roofline.StepLog()
    with log.attach(llm.engine):  # a few microseconds per step of ~10-100 ms
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    hits = kv.prefix_hits - hits
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != sum(r.output for r in lengths):
        raise RuntimeError("quire produced the wrong number of tokens")
    profile = None
    if args.profile:
        # The timed run left the workload's prefixes cached: without the reset this run would
        # revive them and skip most of its prefill.
        if not llm.reset_prefix_cache():
            raise RuntimeError("quire held KV blocks after its run")
        prof = StepProfile()
        before = kv.prefix_hits
        with prof.attach(llm.engine):
            llm.generate(prompts, params)
        profile = prof.report() | {"prefix_hit_tokens": kv.prefix_hits - before}
    return _QuireRun(Rate(produced, elapsed, cpu), log, hits, profile)


def _tensor_parallel(
    model: PreTrainedModel,
    tmp: Path,
    prompts: list[list[int]],
    lengths: list[RequestLengths],
    budget: int,
    args: argparse.Namespace,
    one_rank: Rate,
) -> dict[str, Any]:
    """The same timed run at ``--tensor-parallel-size`` ranks (same KV budget in tokens).

    ``speedup_vs_tp1``: one rank's wall time over this run's. ``collective_share``: the part of
    the wall time rank 0 spends inside all-reduces and the logits' all-gather, waiting for the
    slowest rank included. ``plan_send_share`` / ``plan_send_us_per_step``: pickling each step's
    plan and writing it to the workers' pipes."""
    size = args.tensor_parallel_size
    threads = torch.get_num_threads()  # the engine splits them over its ranks on CPU
    with quire_llm(model, tmp, budget, args, tensor_parallel_size=size) as llm:
        group = llm.engine.parallel
        assert group is not None
        _warm_up(llm, prompts)
        comm0, send0, steps0 = group.comm.comm_seconds, group.publish_seconds, group.steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, request_params(lengths))
        wall = time.perf_counter() - t0
        comm, send = group.comm.comm_seconds - comm0, group.publish_seconds - send0
        steps = group.steps - steps0
    torch.set_num_threads(threads)  # for the systems measured after this one
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != one_rank.tokens:
        raise RuntimeError("quire at tensor parallelism produced the wrong number of tokens")
    return {
        "size": size,
        "threads_per_rank": max(1, args.threads // size) if args.device == "cpu" else None,
        "tok_s": round(produced / wall, 1),
        "tp1_tok_s": round(one_rank.tokens / one_rank.wall_s, 1),
        "speedup_vs_tp1": round(one_rank.wall_s / wall, 2),
        "steps": steps,
        "collective_share": round(comm / wall, 3),
        "plan_send_share": round(send / wall, 4),
        "plan_send_us_per_step": round(send / max(steps, 1) * 1e6, 1),
    }


def quire_llm(
    model: PreTrainedModel,
    tmp: Path,
    budget: int,
    args: argparse.Namespace,
    tensor_parallel_size: int = 1,
) -> LLM:
    """Quire's engine (an ``LLM``) for ``model``, saved under ``tmp``, with a KV pool of
    ``budget`` tokens and this bench's scheduler limits."""
    from quire_engine.engine.llm import LLM

    path = tmp / "model"
    if not path.is_dir():
        model.save_pretrained(path)
        build_tokenizer().save_pretrained(path)
    return LLM(
        str(path),
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=budget // args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
        tensor_parallel_size=tensor_parallel_size,
        threads=args.threads,
    )


def request_params(lengths: list[RequestLengths]) -> list[SamplingParams]:
    """Greedy, EOS ignored, each request its own output length."""
    return [SamplingParams(temperature=0.0, max_tokens=r.output, ignore_eos=True) for r in lengths]
