"""``/tokenize``, ``/detokenize`` and ``/version``, with vLLM's request and response shapes.

``/tokenize`` takes a ``prompt`` (completions' rules: special tokens added unless
``add_special_tokens`` is false) or ``messages`` (through the chat template, as chat completions
would render them) and answers ``{"count", "max_model_len", "tokens"}`` plus ``token_strs`` when
``return_token_strs`` is set. ``/detokenize`` answers ``{"prompt"}`` for a list of token ids.
Tokenizing runs on the prompt encoder's thread, like every prompt.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quire_engine import __version__
from quire_engine.server.prompt_encoder import PromptEncoder
from quire_engine.server.protocol import ChatMessage, Json, OpenAIError, refused
from quire_engine.server.vllm_fields import check_extra


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Json | None = None
    tools: list[Json] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


async def tokenize(
    body: TokenizeRequest, encoder: PromptEncoder, tokenizer: Any, max_model_len: int
) -> Json:
    check_extra(body.model_extra, refused)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        kwargs: Json = dict(body.chat_template_kwargs or {})
        kwargs.update(
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
        if body.chat_template is not None:
            kwargs["chat_template"] = body.chat_template
        if body.tools is not None:
            kwargs["tools"] = body.tools
        conversation = [m.for_template() for m in body.messages]
        ids = await encoder.chat(conversation, kwargs, bool(body.add_special_tokens))
    else:
        assert body.prompt is not None
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await encoder.prompt(body.prompt, add) if body.prompt else []
    out: Json = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = list(tokenizer.convert_ids_to_tokens(ids))
    return out


async def detokenize(body: DetokenizeRequest, encoder: PromptEncoder, vocab_size: int) -> Json:
    check_extra(body.model_extra, refused)
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(
            400, f"tokens must be in [0, {vocab_size}); got {bad[:5]}", param="tokens"
        )
    return {"prompt": await encoder.decode(body.tokens)}


def version() -> Json:
    return {"version": __version__}
