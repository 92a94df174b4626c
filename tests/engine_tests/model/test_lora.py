"""LoRA adapters in the engine, against peft as the oracle.

peft makes random adapters (both A and B random: ``init_lora_weights=False``) for the tiny
checkpoints of the served families and saves them in its own format; the reference of an adapter
is transformers' greedy decode of peft's ``merge_and_unload()`` model, float32. One ``generate``
call mixes the base model and several adapters (different ranks, different target modules) in
the same steps, and each prompt's tokens must be the reference's of its own adapter.

Tie-proof: a merged model computes W' x where the engine computes W x + B (A x), which differ in
rounding; so greedy identity is asserted up to each path's first step whose top-2 margin is below
``TIE_MARGIN`` (where the argmax may flip on any machine), and the compared tokens must make up
most of the paths (a test that compares nothing fails).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from quire_engine import LLM, SamplingParams
from quire_engine.core.config import CacheConfig, PreemptionMode, SchedulerConfig
from quire_engine.core.lora import AdapterSlots, LoRARequest, hash_extra
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import Sequence
from quire_engine.model.tiny_model import build_tokenizer
from tests.engine_tests.models import build, greedy_reference
from tests.engine_tests.ties import TIE_MARGIN

MAX_TOKENS = 16
PROMPTS = [
    list(range(20, 60)),
    [9, 8, 7],
    [100 + i % 30 for i in range(45)],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8],
]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapter(
    base_dir: Path, out: Path, name: str, lora_id: int, rank: int, targets: list[str]
) -> tuple[LoRARequest, Path]:
    """A random peft adapter of ``base_dir`` saved in ``out/name``, and its merged model saved
    in ``out/name-merged`` (the reference)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora_id)
        model = peft.get_peft_model(base, config)
        with torch.no_grad():  # wide enough to move the greedy paths of a 0.3-init model
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.normal_(0.0, 0.15)
    model.save_pretrained(str(out / name))
    merged: Any = model.merge_and_unload()  # the base model's class, untyped by peft
    merged.save_pretrained(out / f"{name}-merged")
    build_tokenizer().save_pretrained(out / f"{name}-merged")  # servable by the engine too
    return LoRARequest(name, lora_id, str(out / name)), out / f"{name}-merged"


@functools.cache
def reference(model_dir: str) -> list[tuple[list[int], list[float]]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [
        (path.tokens, path.margins)
        for path in (greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS)
    ]


def tie_free_prefix(margins: list[float]) -> int:
    """Tokens before the first near-tie: where greedy identity is well defined."""
    return next((i for i, m in enumerate(margins) if m < TIE_MARGIN), len(margins))


def check_against(outputs: list[list[int]], refs: list[str], what: str) -> None:
    compared = total = 0
    for i, (tokens, ref_dir) in enumerate(zip(outputs, refs, strict=True)):
        expected, margins = reference(ref_dir)[i % len(PROMPTS)]
        n = tie_free_prefix(margins)
        assert tokens[:n] == expected[:n], f"{what}: prompt {i} ({ref_dir}) differs"
        compared, total = compared + n, total + len(expected)
    assert compared >= total // 2, f"{what}: only {compared} of {total} tokens tie-free"


# The served families with the modules their two adapters target: attention and MLP (wide), and
# two attention projections (narrow). Phi-3's projections are fused linear layers (qkv_proj,
# gate_up_proj); Mixtral's experts are fused 3-D weights, not linear layers: attention only.
MLP = ["gate_proj", "up_proj", "down_proj"]
PLAIN = ([*ATTENTION, *MLP], ["q_proj", "v_proj"])
FAMILIES: dict[str, tuple[list[str], list[str]]] = {
    "llama": PLAIN,
    "qwen2": PLAIN,
    "qwen3": PLAIN,
    "mistral": PLAIN,
    "gemma2": PLAIN,
    "gemma3": PLAIN,
    "olmo2": PLAIN,
    "granite": PLAIN,
    "phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj"]),
    "mixtral": (ATTENTION, ["q_proj", "v_proj"]),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


def family_setup(workdir: Path, arch: str) -> tuple[Path, list[tuple[LoRARequest, Path]]]:
    base = workdir / arch
    if not base.exists():
        build(arch, base)
    wide, narrow = FAMILIES[arch]
    adapters = [
        make_adapter(base, workdir, f"{arch}-a", 1, 8, wide),
        make_adapter(base, workdir, f"{arch}-b", 2, 4, narrow),
    ]
    return base, adapters


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_a_mixed_batch_matches_each_adapters_merged_model(workdir: Path, arch: str) -> None:
    base, ((a, a_ref), (b, b_ref)) = family_setup(workdir, arch)
    # Every prompt under the base model and both adapters, interleaved in one call.
    prompts = [p for p in PROMPTS for _ in range(3)]
    loras = [None, a, b] * len(PROMPTS)
    refs = [str(r) for _ in PROMPTS for r in (base, a_ref, b_ref)]
    order = [k * 3 + j for j in range(3) for k in range(len(PROMPTS))]  # back to per-ref order
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        outs = llm.generate(prompts, params, lora_request=loras)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    check_against([tokens[i] for i in order], [refs[i] for i in order], f"{arch} mixed batch")
    # The adapters change the output (or the test would prove nothing).
    assert tokens[1] != tokens[0] and tokens[2] != tokens[0]


@pytest.mark.gpu
def test_a_mixed_batch_on_cuda_runs_the_triton_kernels(workdir: Path) -> None:
    base, ((a, a_ref), (b, b_ref)) = family_setup(workdir, "llama")
    prompts = [p for p in PROMPTS for _ in range(3)]
    loras = [None, a, b] * len(PROMPTS)
    refs = [str(r) for _ in PROMPTS for r in (base, a_ref, b_ref)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = {"device": "cuda", "dtype": "float32", "enable_lora": True, "max_loras": 2}
    with LLM(str(base), max_lora_rank=8, **engine) as llm:
        lora = llm.engine.runner.lora
        assert lora is not None and lora.use_triton
        outs = llm.generate(prompts, params, lora_request=loras)
    order = [k * 3 + j for j in range(3) for k in range(len(PROMPTS))]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    check_against([tokens[i] for i in order], [refs[i] for i in order], "cuda mixed batch")


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_adapters_survive_preemption_and_fork(workdir: Path, mode: PreemptionMode) -> None:
    base, ((a, a_ref), (b, b_ref)) = family_setup(workdir, "llama")
    # A pool of 12 blocks of 8 for 8 sequences growing to ~60 tokens: preemption is forced;
    # max_loras 1 with two adapters: the scheduler holds one adapter's requests back at a time.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    engine: dict[str, object] = {
        "block_size": 8,
        "num_blocks": 24,
        "max_model_len": 64,
        "preemption_mode": mode.value,
    }
    if mode is PreemptionMode.SWAP:
        engine["swap_space"] = 0.01
    with LLM(
        str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, **engine
    ) as llm:
        outs = llm.generate(PROMPTS * 2, params, lora_request=[a] * 4 + [b] * 4)
        stats = llm.engine.scheduler.num_preemptions
    assert sum(stats.values()) > 0, "no preemption: the test did not exercise it"
    refs = [a_ref] * 4 + [b_ref] * 4
    for out, prompt_index, ref in zip(outs, list(range(4)) * 2, refs, strict=True):
        for sample in out.outputs:  # n=2 greedy: both samples follow the reference
            expected, margins = reference(str(ref))[prompt_index]
            n = tie_free_prefix(margins)
            assert list(sample.token_ids)[:n] == expected[:n]


def test_beams_of_an_adapter_are_the_merged_models_beams(workdir: Path) -> None:
    # The oracle is the engine's own beam search on peft's merged checkpoint: the same algorithm,
    # so only the adapter path differs. Beams are compared as a set, and in order only where the
    # reference's cumulative log-probabilities are apart by more than a near-tie.
    base, ((a, a_ref), _) = family_setup(workdir, "llama")
    prompt = PROMPTS[3]
    with LLM(str(a_ref), dtype="float32") as llm:
        (ref,) = llm.beam_search([prompt], beam_width=3, max_tokens=6)
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        (out,) = llm.beam_search([prompt], beam_width=3, max_tokens=6, lora_request=a)
        (plain,) = llm.beam_search([prompt], beam_width=3, max_tokens=6)
    beams = [list(b.token_ids) for b in out.outputs]
    expected = [list(b.token_ids) for b in ref.outputs]
    assert sorted(beams) == sorted(expected)
    scores = [b.cumulative_logprob for b in ref.outputs]
    assert all(s is not None for s in scores)
    for k in range(len(scores) - 1):
        if scores[k] - scores[k + 1] > TIE_MARGIN:  # type: ignore[operator]
            assert beams[k] == expected[k], k
    assert beams != [list(b.token_ids) for b in plain.outputs]  # the adapter mattered


def test_the_prefix_cache_never_shares_blocks_across_adapters(workdir: Path) -> None:
    base, ((a, _), (b, _)) = family_setup(workdir, "llama")
    prompt = list(range(20, 60))  # 2 full blocks of 16 reusable
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        cached = []
        for lora in (None, a, b, a, None):
            (out,) = llm.generate([prompt], params, lora_request=lora)
            cached.append(out.num_cached_tokens)
        # b unloaded and its id given to another adapter: b's cached blocks are not its.
        assert llm.engine.remove_adapter(b.lora_int_id)
        reused = LoRARequest("again", b.lora_int_id, a.lora_path)
        (out,) = llm.generate([prompt], params, lora_request=reused)
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 32, 32, 0]
    assert hash_extra(None, 0) is None and hash_extra("t", 0) == "t"
    extras = {hash_extra(None, 1, "/a"), hash_extra(None, 2, "/a"), hash_extra("t", 1, "/a")}
    assert len(extras | {hash_extra(None, 1, "/b")}) == 4


def test_the_scheduler_keeps_a_step_within_max_loras() -> None:
    slots = AdapterSlots(2)
    assert slots.admits([0, 1, 1], 2) and slots.admits([1, 2], 1) and not slots.admits([1, 2], 3)
    assert slots.admits([1, 2], 0)  # the base model takes no slot
    cache = CacheConfig(block_size=4, num_blocks=64)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=32), cache, 1)
    seqs = [
        Sequence(f"s{i}", [1, 2, 3], max_tokens=4, lora_id=lora)
        for i, lora in enumerate([5, 0, 7, 5])
    ]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    # s0 (adapter 5) and s1 (base) run; s2 needs a second slot: it and everything after it wait.
    assert [s.seq_id for s in out.seqs] == ["s0", "s1"]
    assert [s.seq_id for s in sched.waiting] == ["s2", "s3"]
    stats = sched.stats()  # what vllm:lora_requests_info reports
    assert (stats.running_loras, stats.waiting_loras) == ((5,), (5, 7))
    for seq in list(sched.running):
        sched.abort(seq.seq_id)
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == ["s2"]  # s3's adapter 5 is not adapter 7's
    for seq in list(sched.running) + list(sched.waiting):
        sched.abort(seq.seq_id)


def test_bad_adapters_are_refused_before_anything_runs(workdir: Path) -> None:
    base, ((a, _), _) = family_setup(workdir, "llama")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with (
        LLM(str(base), dtype="float32") as llm,
        pytest.raises(ValueError, match="enable_lora is off"),
    ):
        llm.generate([[1, 2]], params, lora_request=a)
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4) as llm:
        with pytest.raises(ValueError, match="rank 8; max_lora_rank is 4"):
            llm.generate([[1, 2]], params, lora_request=a)
        missing = LoRARequest("missing", 3, str(workdir / "nowhere"))
        with pytest.raises(ValueError, match="peft adapter directory"):
            llm.generate([[1, 2]], params, lora_request=missing)
        other = workdir / "narrow-llama"  # another base model: a narrower MLP
        if not other.exists():
            build("llama", other, intermediate_size=96)
        foreign, _ = make_adapter(other, workdir, "foreign", 4, 2, ["gate_proj"])
        with pytest.raises(ValueError, match="another base model"):
            llm.generate([[1, 2]], params, lora_request=foreign)
        assert llm.kv_cache_stats().used == 0
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("x", 0, "/tmp")
