"""The shape of one rank's KV pool and what a token of it costs: ``CacheShape`` (layers, KV
heads, head_dim, block size, the model's dtype and ``--kv-cache-dtype``). The runner allocates
its pools from it; the cache plan sizes the pool with its ``bytes_per_block``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from quire_engine.core.config import KVCacheDtype
from quire_engine.kernels.kv_quant import SCALE_DTYPE

# --kv-cache-dtype -> the pool's 8-bit element dtype (kernels.kv_quant owns the format).
KV_STORAGE = {
    KVCacheDtype.INT8: torch.int8,
    KVCacheDtype.FP8_E4M3: torch.float8_e4m3fn,
    KVCacheDtype.FP8_E5M2: torch.float8_e5m2,
}


@dataclass(frozen=True, slots=True)
class CacheShape:
    """One rank's block shape. ``dtype`` is the model's (what K/V arrive in); ``kv_dtype`` what
    the pool stores: the model's dtype (``AUTO``) or 8 bits plus a float32 scale per token and
    KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_dtype: KVCacheDtype = KVCacheDtype.AUTO

    @property
    def storage_dtype(self) -> torch.dtype:
        """The pools' element dtype."""
        kv = self.kv_dtype.canonical
        return self.dtype if kv is KVCacheDtype.AUTO else KV_STORAGE[kv]

    @property
    def quantized(self) -> bool:
        return self.kv_dtype.quantized

    @property
    def bytes_per_token(self) -> int:
        # K and V, every layer: 2 * layers * kv_heads * (head_dim * element bytes + scale bytes).
        item = self.storage_dtype.itemsize
        scale = SCALE_DTYPE.itemsize if self.quantized else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * item + scale)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @classmethod
    def of(
        cls,
        model: PreTrainedModel,
        block_size: int,
        dtype: torch.dtype,
        num_kv_heads: int | None = None,
        kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    ) -> CacheShape:
        """``num_kv_heads``: this rank's share under tensor parallelism (default: the model's)."""
        cfg: Any = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = num_kv_heads or getattr(cfg, "num_key_value_heads", None) or heads
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, block_size, dtype, kv_dtype)
