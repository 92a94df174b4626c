"""The CPU attention plan (built once per step, replayed per layer) computes exactly what the
reference computes, on a ragged batch mixing decode, fresh prefill and prefill after a cached
prefix, and writes K/V into the same slots. Both paths cut decode batches with one rule
(``decode_chunks``), so the check holds with one sequence per chunk too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quire_engine.cpu.paged_attention import CpuAttentionPlan
from quire_engine.kernels import paged_attention_reference as reference_module
from quire_engine.kernels.kv_cache_ops import write_kv_reference
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_reference import decode_chunks, paged_attention_reference


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("one_seq_per_chunk", [False, True])
def test_plan_equals_reference(
    monkeypatch: pytest.MonkeyPatch, block_size: int, one_seq_per_chunk: bool
) -> None:
    if one_seq_per_chunk:
        monkeypatch.setattr(reference_module, "_DECODE_CHUNK_BYTES", 1)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, num_blocks = 8, 2, 16, 96
    # (context length after the step, new tokens): decode of ragged lengths, a fresh prompt,
    # a prompt after a cached prefix.
    seqs = [(37, 1), (5, 1), (64, 1), (130, 1), (9, 9), (50, 7), (1, 1)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, used = [], [], 0
    for length, _ in seqs:
        nb = -(-length // block_size)
        tables.append(perm[used : used + nb])
        used += nb
    for (length, n), table in zip(seqs, tables, strict=True):
        for pos in range(length - n, length):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    block_tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    counts = [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    seq_lens = np.array([length for length, _ in seqs], dtype=np.int64)
    num_tokens = int(qsl[-1])

    def cache() -> torch.Tensor:
        return torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)

    k_ref, v_ref = cache(), cache()
    k_plan, v_plan = k_ref.clone(), v_ref.clone()
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    slot_tensor = torch.tensor(slots)

    write_kv_reference(key, value, k_ref, v_ref, slot_tensor)
    expected = paged_attention_reference(
        PagedAttentionInputs(
            q, k_ref, v_ref, torch.from_numpy(block_tables), torch.from_numpy(seq_lens).int(),
            torch.from_numpy(qsl).int(), 0.25, max_query_len=max(counts),
            max_seq_len=int(seq_lens.max()),
        )
    )  # fmt: skip

    plan = CpuAttentionPlan.build(
        slots=np.array(slots, dtype=np.int64),
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )
    plan.write_kv(key, value, k_plan, v_plan)
    assert torch.equal(k_plan, k_ref) and torch.equal(v_plan, v_ref)
    got = plan.attend(q, k_plan, v_plan, 0.25)
    assert torch.equal(got, expected)  # same ops on the same data: bit-identical
    decode_lens = sorted((length for length, n in seqs if n == 1), reverse=True)
    num_chunks = len(list(decode_chunks(decode_lens, block_size, kv_heads * head_dim * 4)))
    assert len(plan.decode) == num_chunks
    if one_seq_per_chunk:
        assert num_chunks == len(decode_lens)


def test_decode_chunks_split_at_half_padding_and_at_the_byte_limit() -> None:
    # Block 16, 64 bytes a token: contexts 64, 60, 40 share 4 blocks (each > 32); 20 does not.
    assert list(decode_chunks([64, 60, 40, 20, 18], 16, 64)) == [(0, 3, 4), (3, 5, 2)]
    # A window of 2 blocks: both gather 2 blocks, and 60 > 16 keeps them together.
    assert list(decode_chunks([64, 60, 12], 16, 64, window_blocks=2)) == [(0, 2, 2), (2, 3, 1)]
    # 2 MiB of gathered K per chunk: 4 blocks x 16 tokens x 64 KiB a token is 4 MiB, so one each.
    assert list(decode_chunks([64, 64], 16, 64 << 10)) == [(0, 1, 4), (1, 2, 4)]


def test_lazy_plan_is_built_once() -> None:
    lazy = CpuAttentionPlan.lazy(
        slots=np.array([5], dtype=np.int64),
        block_tables=np.array([[0, 1]], dtype=np.int32),
        seq_lens=np.array([6], dtype=np.int64),
        query_start_loc=np.array([0, 1], dtype=np.int64),
        block_size=4,
        num_kv_heads=1,
        head_dim=8,
    )
    plan = lazy.get()
    assert lazy.get() is plan
    assert [c.rows.tolist() for c in plan.decode] == [[0]] and plan.prefill == []
