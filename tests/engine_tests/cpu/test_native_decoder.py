"""The native decode step (``cpu/csrc/decoder_decode.c``, driven by ``cpu/decoder``).

Its contract: in a pure decode step of at most ``MAX_ROWS`` (64) sequences of a Llama-shaped
model, the logits equal the module path's to rounding (its attention, and its matmuls up to 16
rows, are the same kernels; RMSNorm's sum of squares and SiLU's exp round differently: compared
at 1e-5 of the logits' scale, where fp32 rounding through two layers is ~1e-7) and greedy tokens
are identical, for plain Llama (GQA 8:2), Llama 3.1's RoPE scaling, Mistral's sliding window
(contexts run past it), Qwen2's projection biases, Qwen2 with a windowed and a full layer, and a
Llama with every bias, tied embeddings and sizes that are not multiples of the kernels' 8 lanes.
The token comparison is tie-proof: the module path's every top-2 gap is checked against
``TIE_MARGIN`` first. Every other model or step takes the module path; a model whose modules or
weights changed since the stack was built gets a rebuilt one (never a stale address); an array
of the wrong shape or an index outside the model or the pool is a ``ValueError`` before anything
is written. The HF equivalence suite runs its decode steps through this path too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf

from quire_engine import LLM, SamplingParams
from quire_engine.core.scheduler import PromptLogitSpan, SchedulerOutput
from quire_engine.cpu import decoder as decoder_cpu
from quire_engine.model.runner import ModelRunner
from quire_engine.model.tiny_model import build_tokenizer
from tests.engine_tests.models import COMMON, LOCAL_GLOBAL, WINDOW, build
from tests.engine_tests.ties import TIE_MARGIN
from tests.engine_tests.toolchain import require_native_kernels

REL_TOL = 1e-5


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native_kernels()


def _prompts() -> list[list[int]]:
    # Lengths 1..45: decode contexts from 2 to 75 positions, past Mistral's window of 20.
    return [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((1, 5, 17, 30, 45))]


def _llm(model_dir: Path, num_blocks: int = 64) -> LLM:
    # No prefix cache: a second run must schedule exactly the same steps as the first.
    return LLM(
        str(model_dir),
        device="cpu",
        block_size=16,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
    )


class _Recorder:
    """Every step's logits from the runner, and how many steps any native decoder took."""

    def __init__(self, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
        self.logits: list[torch.Tensor] = []
        self.native_steps = 0
        execute = runner.execute
        decode = decoder_cpu.DecoderStack.decode

        def recording(out: Any) -> torch.Tensor:
            result = execute(out)
            self.logits.append(result.clone())
            return result

        def counting(stack: decoder_cpu.DecoderStack, *args: Any) -> torch.Tensor:
            self.native_steps += 1
            return decode(stack, *args)

        monkeypatch.setattr(runner, "execute", recording)
        monkeypatch.setattr(decoder_cpu.DecoderStack, "decode", counting)


def _generate(llm: LLM, max_tokens: int = 30) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params)]


def _assert_logits_close(native: list[torch.Tensor], module: list[torch.Tensor]) -> None:
    assert len(native) == len(module)
    for step, (a, b) in enumerate(zip(native, module, strict=True)):
        scale = float(b.abs().max())
        err = float((a - b).abs().max())
        assert err <= REL_TOL * scale, f"step {step}: logits differ by {err:.2e} (scale {scale})"


def _every_bias_llama(path: Path) -> Path:
    """A Llama with biases on every projection (random: transformers zero-initialises them),
    tied embeddings, one KV head and sizes off the kernels' 8 lanes (hidden 44, head 22, MLP
    100)."""
    config = tf.LlamaConfig(
        **(COMMON | {"hidden_size": 44, "intermediate_size": 100, "tie_word_embeddings": True}),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=22,
        attention_bias=True,
        mlp_bias=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = tf.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.3)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


MODELS: dict[str, Callable[[Path], Path]] = {
    "llama": lambda p: build("llama", p),
    "llama3-rope": lambda p: build("llama3-rope", p),
    "mistral": lambda p: build("mistral", p),
    "qwen2": lambda p: build("qwen2", p),
    "qwen2-local-global": lambda p: build(
        "qwen2", p, use_sliding_window=True, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL
    ),
    "llama-every-bias": _every_bias_llama,
}


def _assert_tie_free(logits: list[torch.Tensor]) -> None:
    for step, rows in enumerate(logits):
        top2 = torch.topk(rows, 2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        assert gap >= TIE_MARGIN, (
            f"step {step}: a top-2 gap of {gap:.1e} < {TIE_MARGIN}: token identity is not well "
            "defined there; change the prompts or the model's seed"
        )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_steps_match_the_module_path(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(MODELS[name](tmp_path / name))
    runner = llm.engine.runner
    stack = runner.decoder
    assert stack is not None, f"{name} should run through the native decoder"
    if name == "qwen2-local-global":
        assert stack.windows.tolist() == [WINDOW, 0]
    rec = _Recorder(runner, monkeypatch)
    native_tokens = _generate(llm)
    native_logits, native_steps = list(rec.logits), rec.native_steps
    # Every step after the prompts' prefill is a pure decode step of <= 5 sequences.
    assert native_steps >= 29, native_steps
    rec.logits.clear()
    runner.decoder = None  # the module path for every step
    module_tokens = _generate(llm)
    _assert_tie_free(rec.logits)
    assert module_tokens == native_tokens
    _assert_logits_close(native_logits, rec.logits)


@pytest.mark.parametrize("rope", ["default", "llama3", "per-step"])
def test_rope_rows_are_the_rotary_modules_own_values(rope: str, tmp_path: Path) -> None:
    """Fixed frequencies: cos/sin come from a table over positions made by one call of the
    model's rotary module, grown on demand (here 256 rows, then capped at the pool's 1,024
    tokens). RoPE that recomputes its frequencies from each call's positions ("dynamic", which
    the loader refuses, and "longrope", served below its original length) asks the module
    every step ("per-step": that path, forced). Either way each token gets the bits a call for
    its own step gives."""
    llm = _llm(build("llama3-rope" if rope == "llama3" else "llama", tmp_path / rope))
    stack = llm.engine.runner.decoder  # 64 blocks of 16: positions up to 1,023
    assert stack is not None
    rotary: Any = llm.engine.runner.model.model.rotary_emb
    assert stack._rope_static, rotary.rope_type
    assert {"dynamic", "longrope"} <= decoder_cpu._DYNAMIC_ROPE
    if rope == "per-step":
        stack._rope_static = False
    for positions in ([0, 3, 40], [5, 255], [700, 1023, 2], [1023]):
        pos = np.array(positions, dtype=np.int64)
        cos, sin, rows = stack._cos_sin(pos)
        want_cos, want_sin = rotary(torch.empty((1, len(pos), 0)), torch.from_numpy(pos)[None])
        at = torch.from_numpy(rows)
        assert torch.equal(cos[at], want_cos[0]) and torch.equal(sin[at], want_sin[0])
        if rope == "per-step":
            assert rows.tolist() == list(range(len(pos))) and stack._rope_table is None
        else:
            assert rows.tolist() == positions
            assert cos.shape[0] == (256 if max(positions) < 256 else 1024)


def test_other_models_and_steps_take_the_module_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gemma = _llm(build("gemma2", tmp_path / "gemma2"))  # soft-caps, another decoder layer
    assert gemma.engine.runner.decoder is None
    gelu = _llm(build("llama", tmp_path / "gelu", hidden_act="gelu"))
    assert gelu.engine.runner.decoder is None
    model = gelu.engine.runner.model
    runner = gelu.engine.runner
    reason = decoder_cpu.DecoderStack.build(
        model, runner._layers, runner.k_caches, runner.v_caches, 16, _kernel()
    )
    assert reason == "activation 'gelu', not silu"
    # More sequences than the native decoder takes: module path for those steps.
    llm = _llm(build("llama", tmp_path / "llama"), num_blocks=2 * decoder_cpu.MAX_ROWS + 2)
    rec = _Recorder(llm.engine.runner, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([[i + 1, i + 2] for i in range(decoder_cpu.MAX_ROWS + 1)], params)
    assert rec.native_steps == 0


def _kernel() -> Any:
    from quire_engine.cpu import native

    kernel = native.decoder_decode()
    assert kernel is not None
    return kernel


def test_moved_weights_rebuild_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm(build("llama", tmp_path / "llama"))
    runner = llm.engine.runner
    before = runner.decoder
    assert before is not None
    reference = _generate(llm, 12)
    down = runner.model.model.layers[1].mlp.down_proj
    down.weight.data = down.weight.data.clone()  # new storage, same values
    assert not before.current()
    assert _generate(llm, 12) == reference
    rebuilt = runner.decoder
    assert rebuilt is not None and rebuilt is not before and rebuilt.current()
    # New values: the native path must read them, i.e. agree with the module path on them.
    down.weight.data = down.weight.data * 1.5
    rec = _Recorder(runner, monkeypatch)
    changed = _generate(llm, 12)
    assert runner.decoder is not None and runner.decoder is not rebuilt
    assert rec.native_steps >= 11
    native_logits = list(rec.logits)
    rec.logits.clear()
    runner.decoder = None
    assert _generate(llm, 12) == changed
    _assert_logits_close(native_logits, rec.logits)


def test_a_replaced_module_is_never_run_from_the_old_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapping a module (here a plain ``nn.Linear`` for a projection, as an adapter library
    would) keeps the old module alive, so its addresses stay valid: ``current`` must notice the
    module itself. The new one is not routed to the few-row kernel, so the model no longer fits
    and every later step runs the modules."""
    llm = _llm(build("llama", tmp_path / "llama"))
    runner = llm.engine.runner
    stack = runner.decoder
    assert stack is not None
    mlp = runner.model.model.layers[0].mlp
    fresh = torch.nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    with torch.no_grad():
        fresh.weight.copy_(mlp.up_proj.weight * 0.5)
    mlp.up_proj = fresh
    assert not stack.current()
    rec = _Recorder(runner, monkeypatch)
    _generate(llm, 6)
    assert runner.decoder is None and rec.native_steps == 0


def _captured_inputs(llm: LLM) -> tuple[decoder_cpu.DecoderStack, list[np.ndarray]]:
    """The stack and the arguments of one of its real decode calls."""
    stack = llm.engine.runner.decoder
    assert stack is not None
    calls: list[list[np.ndarray]] = []
    decode = stack.decode

    def capturing(
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        seq_lens: np.ndarray,
    ) -> torch.Tensor:
        args = [input_ids, positions, slots, tables, seq_lens]
        calls.append([a.copy() for a in args])
        return decode(*args)

    stack.decode = capturing  # type: ignore[method-assign]
    _generate(llm, 4)
    stack.decode = decode  # type: ignore[method-assign]
    assert calls
    return stack, calls[-1]


def _change(args: list[np.ndarray], index: int, fn: Callable[[np.ndarray], None]) -> list[Any]:
    changed = [a.copy() for a in args]
    fn(changed[index])
    return changed


def test_indices_outside_the_model_or_pool_are_refused(tmp_path: Path) -> None:
    llm = _llm(build("llama", tmp_path / "llama"))
    stack, args = _captured_inputs(llm)
    runner = llm.engine.runner
    pools = [c.clone() for c in runner.k_caches + runner.v_caches]
    ids, positions, slots, tables, lens = range(5)

    def set_first(value: int) -> Callable[[np.ndarray], None]:
        def put(a: np.ndarray) -> None:
            a.flat[0] = value

        return put

    bad = {
        "token ids outside": _change(args, ids, set_first(stack.dims.vocab_rows)),
        "negative token": _change(args, ids, set_first(-1)),
        "block id outside": _change(args, tables, set_first(stack.num_blocks)),
        "lengths": _change(args, lens, set_first(args[tables].shape[1] * 16 + 1)),
        "slot outside": _change(args, slots, set_first(stack.num_blocks * 16)),
        "last position": _change(args, positions, set_first(0)),
        "short slots": [*args[:slots], args[slots][:-1], *args[slots + 1 :]],
        "short lengths": [*args[:lens], args[lens][:-1]],
        "flat tables": [*args[:tables], args[tables].ravel(), *args[tables + 1 :]],
        "short tables": [*args[:tables], args[tables][:-1], *args[tables + 1 :]],
    }
    for what, call in bad.items():
        with pytest.raises(ValueError):
            stack.decode(*call)
        after = runner.k_caches + runner.v_caches
        assert all(torch.equal(a, b) for a, b in zip(pools, after, strict=True)), what
    too_many = decoder_cpu.MAX_ROWS + 1
    with pytest.raises(ValueError, match=rf"1\.\.{too_many - 1} sequences"):
        stack.decode(*(np.resize(a, (too_many, *a.shape[1:])) for a in args))


def test_a_stand_in_model_is_not_bypassed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench step`` replaces the runner's model with a stand-in: the native decoder, built for
    the real model, must not run in its place."""
    llm = _llm(build("llama", tmp_path / "llama"))
    runner = llm.engine.runner
    rec = _Recorder(runner, monkeypatch)
    real = runner.model
    calls = 0

    def stand_in(**kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(**kwargs)

    runner.model = stand_in  # type: ignore[assignment]
    _generate(llm, 6)
    assert rec.native_steps == 0 and calls >= 6


def test_a_rows_logits_do_not_depend_on_its_batch(tmp_path: Path) -> None:
    """One-token prompts make every step a pure decode step: a sequence decoded alone and in a
    batch of 31 (past the 16 rows where the module path would switch to the BLAS) gets the same
    bits at every step."""
    llm = _llm(build("llama", tmp_path / "llama"))
    engine = llm.engine
    seen: dict[int, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(
        out: SchedulerOutput, prompt_spans: Sequence[PromptLogitSpan] = ()
    ) -> torch.Tensor:
        logits = execute(out, prompt_spans)
        for row, seq in enumerate(out.seqs):
            if seq.prompt_token_ids == [5]:
                seen.setdefault(len(out.seqs), []).append(logits[row].clone())
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([[5]], params)
    llm.generate([[5]] + [[100 + i] for i in range(30)], params)
    assert sorted(seen) == [1, 31] and len(seen[1]) == len(seen[31]) == 12
    for step, (alone, batched) in enumerate(zip(seen[1], seen[31], strict=True)):
        assert torch.equal(alone, batched), f"step {step}"
