"""The only bridge between the pure-Python control side and tensors.

Owns the model and the KV cache tensors (device pool, CPU swap pool and the host tier's
``HostPool``). Each ``execute`` call takes a ``SchedulerOutput``, performs its block moves
(swap-outs and host-tier offloads, then swap-ins, host-tier loads and copy-on-write copies, in
that order, before any K/V of the step is written), packs the step's new tokens of every sequence
into one row, runs the forward pass with paged attention and returns the logits of the sequences
that sample this step. On CPU a pure decode step of a few sequences of a Llama-shaped model runs
as one native call instead of the model's modules (``cpu/decoder``), on the same pools; a
``forward_observer`` (instrumentation: ``engine/profile``) is told the CPU time of those steps.

"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import mmap
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel

from quire_engine.core.lora import AdapterChange
from quire_engine.core.scheduler import PromptLogitSpan, SchedulerOutput
from quire_engine.cpu import decoder as decoder_cpu
from quire_engine.cpu import linear as linear_cpu
from quire_engine.cpu import native
from quire_engine.cpu.paged_attention import CpuAttentionPlan
from quire_engine.kernels.kv_cache_ops import copy_blocks, swap_blocks
from quire_engine.kernels.kv_quant import SCALE_DTYPE, FixedScales, LayerKV
from quire_engine.kernels.triton_runtime import triton_usable
from quire_engine.model import attention
from quire_engine.model.cache_shape import CacheShape
from quire_engine.model.host_pool import HostPool

if TYPE_CHECKING:
    from quire_engine.model.cache_plan import CachePlan
    from quire_engine.model.loader import LoadedModel
    from quire_engine.model.lora import LoRAModel

logger = logging.getLogger(__name__)


class ForwardObserver(Protocol):
    """What instrumentation (``engine/profile``) learns from inside a step's forward."""

    def on_native_decode(self, cpu_ns: int) -> None:
        """A step whose whole forward ran as one native call (``cpu/decoder``) took ``cpu_ns``
        thread CPU nanoseconds."""


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on CPU backed by a private anonymous mapping, page-aligned, which the
    kernel provides zero-filled page by page on first touch: allocating a pool costs nothing
    until its blocks are written (writing zeros into a 2 GiB pool up front takes seconds on a
    small CPU), and the process's resident memory grows with the blocks used. The flip side: a
    memory limit below the pool's size shows when the pool fills, not at start."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # fd -1: MAP_ANONYMOUS
    # The tensor holds the mapping (frombuffer keeps its exporter alive).
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        shape: CacheShape,
        *,
        num_blocks: int,
        num_cpu_blocks: int,
        device: torch.device,
        layers: Sequence[attention.LayerAttention] = (),
        native_linears: bool = True,
        fixed_scales: Sequence[FixedScales] | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        """``layers``: every layer's attention as ``attention.inspect_layers`` audited it
        (the loader's ``LoadedModel.layers``); without it the native decoder stays off.
        ``native_linears=False`` keeps the model's own linear modules and the native decoder
        off (tensor parallelism: the sharded modules communicate). ``fixed_scales``: an 8-bit
        pool's per-layer checkpoint scales (None: dynamic per-token scales).
        ``num_host_blocks``: the host tier under the prefix cache (0: none)."""
        attention.register()
        model.set_attn_implementation(attention.ATTENTION_NAME)
        self.model = model
        self.shape = shape
        self.device = device
        self.use_triton = triton_usable(device)
        # CPU decode attention through the native kernel when it builds (pools of fp32, bf16 or
        # 8 bits; it logs why not otherwise): it reads blocks in place instead of gathering them.
        self.native_decode = (
            native.paged_decode()
            if device.type == "cpu"
            and not self.use_triton
            and shape.storage_dtype in native.PAGED_KV_KINDS
            else None
        )
        # Matmuls of a few rows (small-batch decode) through the native kernel on CPU: the BLAS
        # packs each weight before using it, the kernel streams it once. fp32 weights only.
        self.native_linears = 0
        if native_linears and device.type == "cpu" and not self.use_triton:
            kernel = native.skinny_linear()
            if kernel is not None:
                self.native_linears = linear_cpu.install(model, kernel)
        block = (shape.block_size, shape.num_kv_heads, shape.head_dim)
        # Zero-initialised: padded reads past a sequence's end must see finite values (an 8-bit
        # zero is 0.0 in every format, and a zero scale reads back as 0).
        # Per layer: [num_blocks, block_size, kv_heads, head_dim] of the storage dtype, and for
        # 8-bit pools [num_blocks, block_size, kv_heads] float32 scales.
        pool, count, kind = (num_blocks, *block), shape.num_layers, shape.storage_dtype
        self.k_caches = [zeroed(pool, kind, device) for _ in range(count)]
        self.v_caches = [zeroed(pool, kind, device) for _ in range(count)]
        scales = count if shape.quantized else 0
        self.k_scales = [zeroed(pool[:3], SCALE_DTYPE, device) for _ in range(scales)]
        self.v_scales = [zeroed(pool[:3], SCALE_DTYPE, device) for _ in range(scales)]
        self.cpu_k_caches = self._swap_pool(num_cpu_blocks, block, kind)
        self.cpu_v_caches = self._swap_pool(num_cpu_blocks, block, kind)
        self.cpu_k_scales = self._swap_pool(num_cpu_blocks if scales else 0, block[:2])
        self.cpu_v_scales = self._swap_pool(num_cpu_blocks if scales else 0, block[:2])
        if fixed_scales is not None and (not shape.quantized or len(fixed_scales) != count):
            raise ValueError(
                f"fixed KV scales ({len(fixed_scales)} layers) need an 8-bit pool of {count} "
                f"layers; the pool is {shape.storage_dtype}"
            )
        self.fixed_scales = tuple(fixed_scales) if fixed_scales is not None else None
        fixed = list(fixed_scales) if fixed_scales is not None else [None] * count
        self.host_pool = (
            HostPool(self.device_pools, num_host_blocks, device, zeroed)
            if num_host_blocks
            else None
        )
        self._kv_layers = [
            LayerKV(k, v, ks, vs, f)
            for k, v, ks, vs, f in itertools.zip_longest(
                self.k_caches, self.v_caches, self.k_scales, self.v_scales, fixed
            )
        ]
        # Pure decode steps of a few sequences as one native call (cpu/decoder.py)
        # where the model is Llama-shaped; every other step runs the model's modules.
        self._layers = tuple(layers)
        self.decoder: decoder_cpu.DecoderStack | None = None
        if self.native_linears and self.native_decode is not None and self._layers:
            self.decoder = self._build_decoder()
        # Tensor parallelism: sends each step's plan to the other ranks before this one runs it.
        self.publish: Callable[[StepPlan], None] | None = None
        # Instrumentation's hook inside the forward (the clock is read only while one is set).
        self.forward_observer: ForwardObserver | None = None
        # LoRA adapters (model/lora), installed by the engine's build when enable_lora is on.
        self.lora: LoRAModel | None = None
        # Host array -> tensor on the device; on CPU the numpy buffer itself (``.to`` would be a
        # no-op costing a dispatcher round trip per input per step).
        self._put: Callable[[np.ndarray], torch.Tensor] = (
            torch.from_numpy
            if device.type == "cpu"
            else lambda a: torch.from_numpy(a).to(device, non_blocking=True)
        )

    @classmethod
    def from_plan(
        cls, loaded: LoadedModel, plan: CachePlan, device: torch.device, *, native_linears: bool
    ) -> ModelRunner:
        """The runner of ``loaded`` on a cache plan: its block shape, device, swap and host pool
        sizes and fixed scales (what rank 0's build and every tensor-parallel worker build)."""
        return cls(
            loaded.model,
            plan.shape,
            num_blocks=plan.num_blocks,
            num_cpu_blocks=plan.num_cpu_blocks,
            device=device,
            layers=loaded.layers,
            native_linears=native_linears,
            fixed_scales=plan.fixed_scales,
            num_host_blocks=plan.num_host_blocks,
        )

    def _swap_pool(
        self, num_cpu_blocks: int, block: tuple[int, ...], dtype: torch.dtype = SCALE_DTYPE
    ) -> list[torch.Tensor]:
        """One layer's CPU swap blocks (of data, or of scales) per layer (none without swap);
        pinned (page-locked at once) when the device is CUDA, for asynchronous copies."""
        if not num_cpu_blocks:
            return []
        shape = (num_cpu_blocks, *block)
        if self.device.type == "cuda":
            return [
                torch.zeros(shape, dtype=dtype, pin_memory=True)
                for _ in range(self.shape.num_layers)
            ]
        return [zeroed(shape, dtype, torch.device("cpu")) for _ in range(self.shape.num_layers)]

    def _build_decoder(self) -> decoder_cpu.DecoderStack | None:
        kernel = native.decoder_decode()
        if kernel is None:
            return None
        # An 8-bit pool's scale pools, and its fixed scales when every layer has them.
        fixed = [kv.fixed for kv in self._kv_layers if kv.fixed is not None]
        built = decoder_cpu.DecoderStack.build(
            self.model, self._layers, self.k_caches, self.v_caches, self.shape.block_size, kernel,
            self.k_scales, self.v_scales, fixed or None,
        )  # fmt: skip
        if isinstance(built, str):
            logger.info("native decoder off for this model (module path only): %s", built)
            return None
        return built

    def _native_step(self, x: StepInputs) -> torch.Tensor | None:
        """The step through the native decoder when it applies (see ``decoder_cpu``), else
        None. The stack is rebuilt, or dropped, when the model changed since (``current``)."""
        stack = self.decoder
        num_seqs = len(x.counts)
        if (
            stack is None
            or stack.model is not self.model  # e.g. bench step's stand-in forward
            or x.lora_ids is not None  # adapters run through the modules' forwards
            or x.max_query_len != 1
            or len(x.sample_rows) != num_seqs
            or num_seqs > decoder_cpu.MAX_ROWS
        ):
            return None
        if not stack.current():
            stack = self.decoder = self._build_decoder()
            if stack is None:
                return None
        return stack.decode(x.input_ids, x.positions, x.slots, x.tables, x.seq_lens)

    def execute(
        self, out: SchedulerOutput, prompt_spans: Sequence[PromptLogitSpan] = ()
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [num_sampling_seqs + prompt rows, vocab]: the
        sampling rows in batch order, then the rows of ``prompt_spans`` in their order."""
        lora = self.lora
        plan = plan_step(out, prompt_spans, lora=lora is not None)
        if self.publish is not None:
            if lora is not None:  # the adapters the other ranks must add or remove first
                plan = dataclasses.replace(plan, adapters=lora.take_changes())
            self.publish(plan)
        return self.run(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """``execute`` from the step's host arrays: what every tensor-parallel rank runs."""
        self._move_blocks(plan)
        x = plan.inputs
        keep = x.sample_rows if plan.keep is None else plan.keep
        if plan.keep is None:
            observer = self.forward_observer
            started = time.thread_time_ns() if observer is not None else 0
            native_logits = self._native_step(x)
            if native_logits is not None:
                if observer is not None:  # only the steps it ran count
                    observer.on_native_decode(time.thread_time_ns() - started)
                return native_logits
        dev = self.device
        cpu_plan = None
        if dev.type == "cpu" and not self.use_triton:
            shape = self.shape
            cpu_plan = CpuAttentionPlan.lazy(
                slots=x.slots,
                block_tables=x.tables,
                seq_lens=x.seq_lens,
                query_start_loc=x.qsl,
                block_size=shape.block_size,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                native=self.native_decode,
                num_threads=torch.get_num_threads(),
            )
        put = self._put
        md = attention.AttentionMetadata(
            kv_caches=self._kv_layers,
            slot_mapping=put(x.slots),
            block_tables=put(x.tables),
            seq_lens=put(x.seq_lens.astype(np.int32)),
            query_start_loc=put(x.qsl.astype(np.int32)),
            max_query_len=x.max_query_len,
            max_seq_len=int(x.seq_lens.max()),
            use_triton=self.use_triton,
            cpu_plan=cpu_plan,
        )
        lora = self.lora
        if lora is not None:
            lora.prepare(x.lora_ids, x.counts)
        elif x.lora_ids is not None:
            raise RuntimeError("a step with LoRA adapters on a runner without LoRA")
        try:
            result = self.model(
                input_ids=put(x.input_ids).unsqueeze(0),
                position_ids=put(x.positions).unsqueeze(0),
                use_cache=False,
                logits_to_keep=put(keep),
                quire_metadata=md,
            )
        finally:
            if lora is not None:
                lora.finish()
        return result.logits[0].float()  # [num_sampling_seqs, vocab]

    @property
    def kv_scales(self) -> str:
        """Where the pool's scales come from: none (not 8-bit), dynamic (per token, computed
        on write) or checkpoint (the checkpoint's per-layer fp8 scales)."""
        if not self.shape.quantized:
            return "none"
        return "checkpoint" if self.fixed_scales is not None else "dynamic"

    @property
    def device_pools(self) -> list[torch.Tensor]:
        """Every block-major tensor of the device pool, data then scales: what a block is."""
        return [*self.k_caches, *self.v_caches, *self.k_scales, *self.v_scales]

    @property
    def swap_pools(self) -> list[torch.Tensor]:
        """The CPU swap pool's tensors, in ``device_pools``' order."""
        return [*self.cpu_k_caches, *self.cpu_v_caches, *self.cpu_k_scales, *self.cpu_v_scales]

    def _move_blocks(self, plan: StepPlan) -> None:
        # Order matters: every read of a device block the step may overwrite comes first (a
        # swap-out's, and an offload's: an evicted block is the next holder's fresh block, maybe
        # a swap-in, load or CoW destination), then the writes. The scales move in the same calls
        # as the bytes they scale.
        host = self.host_pool
        if host is not None:
            host.finish()  # the last step's offloads into the host tensors (CUDA)
        if plan.swap_out:
            swap_blocks(self.device_pools, self.swap_pools, plan.swap_out)
        if plan.offload:
            assert host is not None, "host-tier moves without a host tier"
            host.offload(self.device_pools, plan.offload)
        if plan.swap_in:
            swap_blocks(self.swap_pools, self.device_pools, plan.swap_in)
        if plan.load:
            assert host is not None, "host-tier moves without a host tier"
            host.load(self.device_pools, plan.load)
        if plan.block_copies:
            copy_blocks(
                [*self.k_caches, *self.k_scales], [*self.v_caches, *self.v_scales],
                plan.block_copies,
            )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Host arrays of one step, all in batch order (``T`` new tokens of ``S`` sequences)."""

    counts: np.ndarray  # int64 [S]: new tokens per sequence
    qsl: np.ndarray  # int64 [S + 1]: query start locations (cumulative counts)
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]: block_id * block_size + offset
    tables: np.ndarray  # int32 [S, max_blocks], zero-padded
    input_ids: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int64 [S]: context length after the step
    sample_rows: np.ndarray  # int64 [rows]: index in T of each sampled token
    max_query_len: int  # the most new tokens of one sequence
    lora_ids: np.ndarray | None = None  # int64 [S]: each sequence's adapter; None: all base


def build_step_inputs(out: SchedulerOutput, *, lora: bool = False) -> StepInputs:
    """Vectorized: one pass over the sequences in Python (their token ids and block tables are
    Python lists), everything else in numpy, so a step of hundreds of decode sequences costs
    tens of microseconds here rather than one slice and one row copy per sequence."""
    num_seqs = len(out.seqs)
    starts = np.fromiter(out.start_positions, dtype=np.int64, count=num_seqs)
    decode = all(out.samples) and sum(out.num_new_tokens) == num_seqs
    if decode:
        # Pure decode: one token per sequence, its last known one (it samples, so the step ends
        # there), at its start position. Read through C-level getters: no Python frame per row.
        num_tokens = num_seqs
        counts = np.ones(num_seqs, dtype=np.int64)
        qsl = np.arange(num_seqs + 1, dtype=np.int64)
        positions = starts
        seq_index = qsl[:-1]
        sample_rows = seq_index  # every sequence samples its only token
        max_query_len = 1
        input_ids = np.fromiter(
            map(_last, map(_token_ids, out.seqs)), dtype=np.int64, count=num_tokens
        )
    else:
        counts = np.fromiter(out.num_new_tokens, dtype=np.int64, count=num_seqs)
        num_tokens = int(counts.sum())
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        # Positions of every new token: start of its sequence + offset within the step.
        seq_index = np.repeat(np.arange(num_seqs), counts)
        positions = starts[seq_index] + (np.arange(num_tokens) - qsl[:-1][seq_index])
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                seq.token_ids[s : s + n]
                for seq, s, n in zip(out.seqs, out.start_positions, out.num_new_tokens, strict=True)
            ),
            dtype=np.int64,
            count=num_tokens,
        )
        sample_rows = (qsl[1:] - 1)[np.fromiter(out.samples, dtype=bool, count=num_seqs)]
        max_query_len = int(counts.max())
    tables = _pad_tables(out.block_tables)  # [num_seqs, max_blocks]
    bs = out.block_size
    slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
    lora_ids = None  # the base model alone: always without LoRA, so nothing read per step then
    if lora:
        ids = np.fromiter(map(_lora_id, out.seqs), dtype=np.int64, count=num_seqs)
        lora_ids = ids if ids.any() else None
    return StepInputs(
        counts, qsl, positions, slots, tables, input_ids, starts + counts, sample_rows,
        max_query_len, lora_ids,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything a rank needs to run one step, as plain host data (picklable: under tensor
    parallelism rank 0 sends it to the other ranks). ``keep``: the rows of logits to compute
    when prompt logprobs add rows; None for the sampling rows alone. ``adapters``: the adapter
    changes rank 0 made since its last plan, which the other ranks repeat before running it."""

    inputs: StepInputs
    keep: np.ndarray | None  # int64 [rows]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    offload: Sequence[tuple[int, int]] = ()  # (device, host): host-tier offloads
    load: Sequence[tuple[int, int]] = ()  # (host, device): host-tier loads
    adapters: Sequence[AdapterChange] = ()


def plan_step(
    out: SchedulerOutput, prompt_spans: Sequence[PromptLogitSpan] = (), *, lora: bool = False
) -> StepPlan:
    """``lora``: the runner serves adapters, so each sequence's adapter id is read."""
    x = build_step_inputs(out, lora=lora)
    keep = None
    if prompt_spans:
        # A span's rows are its sequence's new tokens from position ``first`` on.
        extra = [
            x.qsl[s.batch_index]
            + (s.first - out.start_positions[s.batch_index])
            + np.arange(s.rows)
            for s in prompt_spans
        ]
        keep = np.concatenate([x.sample_rows, *extra]).astype(np.int64)
    return StepPlan(x, keep, out.swap_out, out.swap_in, out.block_copies, out.offload, out.load)


_token_ids = attrgetter("token_ids")
_lora_id = attrgetter("lora_id")
_last = itemgetter(-1)


def _pad_tables(tables: list[array[int]]) -> np.ndarray:
    """``[num_seqs, max_blocks]`` int32, zero-padded (padding id 0 is never read). The tables
    are int32 arrays: their buffers are joined in one C call and scattered under a length mask,
    so no block id passes through a Python int here."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lens.max())
    flat = np.frombuffer(b"".join(tables), dtype=np.int32)
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < lens[:, None]] = flat  # row-major mask order = concatenation order
    return out
