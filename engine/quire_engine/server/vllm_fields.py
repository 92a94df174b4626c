"""Request fields Quire knows but does not honour: each is a 400 naming it once set to anything
but its neutral value, never silently dropped.

Ownership: the one list of such fields (vLLM's OpenAI-server extensions Quire has not built).
Fields no server knows are accepted and logged, as vLLM does, because clients send fields of
newer API versions; see ``check_extra``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

# field -> the values that ask for nothing (what vLLM treats as unset).
REFUSED: Mapping[str, tuple[Any, ...]] = {
    "watermarking": (None, False),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (None,),
    "logprob_token_ids": (None,),
    "prompt_embeds": (None,),
    "priority": (0, None),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
    "stream_interval": (None, 1),
    "routed_experts_prompt_start": (0,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "reasoning_effort": (None,),
    "return_prompt_text": (None, False),
    "return_token_ids": (None, False),
    "function_call": (None,),
    "functions": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}
# vLLM fields whose neutral value is the only behaviour: accepted and ignored on purpose.
HARMLESS = frozenset(
    {"session_id", "return_token_offsets", "return_mm_kwargs", "store", "metadata", "service_tier"}
)


def check_extra(extra: Mapping[str, Any] | None, refused_error: Callable[[str], Exception]) -> None:
    """Raise ``refused_error(field)`` for the first refused field set to a non-neutral value;
    log the fields no server knows."""
    if not extra:
        return
    unknown = []
    for name, value in extra.items():
        neutral = REFUSED.get(name)
        if neutral is not None:
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise refused_error(name)
        elif name not in HARMLESS:
            unknown.append(name)
    if unknown:
        logger.warning("ignored request fields: %s", ", ".join(sorted(unknown)))
