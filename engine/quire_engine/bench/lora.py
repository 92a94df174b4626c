"""LoRA adapters: the throughput of one batch mixing 1, 4 or 16 adapters against the base model
alone (same requests, same engine settings), and the time to load an adapter.

The adapters are random peft-format directories written here for the model's shape (rank
``--rank`` on every attention and MLP projection of every layer, so each adapter token adds the
most work an adapter can); requests take the adapters round-robin, so every step of a mixed run
holds all of them. Each setting runs ``--repeats`` times on a fresh engine, settings interleaved
(medians reported), closed-loop through ``LLM.generate``: tokens per second are generated tokens
over the call's wall time. ``ratios``: each setting over the base model alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quire_engine.bench import throughput
from quire_engine.bench.kv_offload import preset_model_path
from quire_engine.core.lora import LoRARequest
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm import LLM
from quire_engine.model.tiny_model import TINY_VOCAB_SIZE, save_tiny_model

PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="32m", help="bench throughput's preset model; 'tiny': the embedded one"
    )
    parser.add_argument("--adapters", default="1,4,16", help="adapters mixed in one batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)


def write_adapter(model_dir: str, out: Path, rank: int, seed: int) -> Path:
    """A random peft adapter of rank ``rank`` on every projection of the checkpoint's layers."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {  # (out, in) of each projection
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                rows, cols = shapes[name]
                stem = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, cols, generator=gen) * 0.02
                tensors[f"{stem}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = [n for names in PROJECTIONS.values() for n in names]
    adapter_config: dict[str, Any] = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    adapter_config |= {"bias": "none", "target_modules": targets}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    counts = [int(k) for k in args.adapters.split(",")]
    if any(k < 1 for k in counts) or args.rank < 1 or args.requests < 1:
        raise ValueError("--adapters, --rank and --requests must be >= 1")
    tiny = args.preset == "tiny"
    vocab = TINY_VOCAB_SIZE if tiny else throughput.parse(["--preset", args.preset]).vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    out: dict[str, Any] = {"preset": args.preset, "rank": args.rank, "requests": args.requests}
    with tempfile.TemporaryDirectory() as tmp:
        if tiny:
            model = str(save_tiny_model(Path(tmp) / "tiny"))
        else:
            model = preset_model_path(argparse.Namespace(preset=args.preset), Path(tmp))
        adapters = [
            LoRARequest(
                f"a{i}", i + 1, str(write_adapter(model, Path(tmp) / f"a{i}", args.rank, i))
            )
            for i in range(max(counts))
        ]
        settings = [0, *counts]  # 0: the base model alone, LoRA off
        runs: dict[int, list[float]] = {k: [] for k in settings}
        for _ in range(args.repeats):
            for k in settings:
                runs[k].append(_tokens_per_s(model, k, adapters, prompts, params, args))
        rates = {k: statistics.median(v) for k, v in runs.items()}
        out["tokens_per_s"] = {("base" if k == 0 else f"{k}_adapters"): round(rates[k], 1)
                               for k in settings}  # fmt: skip
        out["ratios_over_base"] = {f"{k}_adapters": round(rates[k] / rates[0], 3) for k in counts}
        out["load"] = _load_times(model, adapters, args)
    return out


def _engine(model: str, k: int, args: argparse.Namespace) -> LLM:
    lora = {"enable_lora": True, "max_loras": k, "max_lora_rank": args.rank} if k else {}
    engine = {"device": "cpu", "dtype": "float32", "max_num_seqs": args.requests}
    return LLM(model, threads=args.threads, **engine, **lora)


def _tokens_per_s(
    model: str,
    k: int,
    adapters: list[LoRARequest],
    prompts: list[list[int]],
    params: SamplingParams,
    args: argparse.Namespace,
) -> float:
    loras = [adapters[i % k] for i in range(len(prompts))] if k else None
    with _engine(model, k, args) as llm:
        llm.generate(prompts[:2], params, lora_request=loras[:2] if loras else None)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _load_times(
    model: str, adapters: list[LoRARequest], args: argparse.Namespace
) -> dict[str, Any]:
    """Reading and checking one adapter (what the server does off the step loop), then copying
    it into a step's slot (on the step loop, the first time a step needs it)."""
    with _engine(model, len(adapters), args) as llm:
        lora = llm.engine.runner.lora
        assert lora is not None
        read, slot = [], []
        for request in adapters:
            start = time.perf_counter()
            weights = lora.insert(lora.load(request))
            read.append(time.perf_counter() - start)
            start = time.perf_counter()
            lora.fill_slot(request.lora_int_id)
            slot.append(time.perf_counter() - start)
        size = sum(a.numel() + b.numel() for a, b in weights.modules.values()) * 4
    return {
        "adapter_mb": round(size / 1e6, 2),
        "read_ms_p50": round(statistics.median(read) * 1e3, 2),
        "slot_copy_ms_p50": round(statistics.median(slot) * 1e3, 2),
    }
