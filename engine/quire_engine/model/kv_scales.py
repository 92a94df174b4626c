"""Per-tensor KV cache scales a checkpoint carries: what llm-compressor (and vLLM's fp8
checkpoints) write for each attention layer, ``model.layers.N.self_attn.k_scale`` and
``.v_scale`` (older files: ``...k_proj.output_scale`` / ``v_proj.output_scale``), float32 scalars
such that ``k_fp8 = k / k_scale``.

Read once at load time from the checkpoint's safetensors headers and values (transformers drops
these keys as unexpected). They are used only for the fp8 formats, and only when every layer has
both: a partial set is logged and ignored (the pool then takes dynamic per-token scales), never
filled with 1.0.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from safetensors import safe_open

from quire_engine.kernels.kv_quant import FixedScales

logger = logging.getLogger(__name__)

_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def read_kv_scales(path: Path, num_layers: int) -> tuple[FixedScales, ...] | None:
    """Every layer's (k_scale, v_scale) from the safetensors files in ``path``, or None when the
    checkpoint has none or not all of them; ``ValueError`` for a scale that is not a positive
    finite scalar."""
    found: dict[tuple[int, str], float] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                match = _KEY.search(key)
                if match is None:
                    continue
                layer, kind = int(match.group(1)), match.group(2) or match.group(3)
                tensor = f.get_tensor(key)
                value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
                if value is None or not (0 < value < float("inf")):
                    raise ValueError(
                        f"{file.name}: {key} must be one positive finite scale, got "
                        f"{tuple(tensor.shape)} {tensor.flatten()[:4].tolist()}"
                    )
                found[(layer, kind)] = value
    if not found:
        return None
    want = {(i, kind) for i in range(num_layers) for kind in "kv"}
    if found.keys() != want:
        logger.warning(
            "the checkpoint has KV scales for %d of %d (layer, K/V) pairs: ignored, the pool "
            "uses dynamic per-token scales",
            len(found.keys() & want),
            len(want),
        )
        return None
    return tuple(FixedScales(found[(i, "k")], found[(i, "v")]) for i in range(num_layers))
