"""Prompts to token ids for the server, off the event loop.

Ownership: one ``PromptEncoder`` per app, created once the model is ready, with a tokenizer copy
of its own used only by its single worker thread: tokenizing or templating a large body takes
long enough to stall every stream if done on the event loop, and the event loop's own tokenizer
(rendering) is then never used by two threads at once. ``close()`` when the app stops.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from quire_engine.server.protocol import OpenAIError


class PromptEncoder:
    """``prompt`` (text or token ids) and ``chat`` (a conversation through the chat template),
    each answered on the worker thread; template errors are 400s naming ``messages``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quire-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return prompt  # token ids: the engine checks their range
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        ids: list[int] = await self._run(self._encode, prompt, add_special_tokens)
        return ids

    async def chat(
        self,
        conversation: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        add_special_tokens: bool = False,
    ) -> list[int]:
        """``template_kwargs``: ``add_generation_prompt``, ``tools``, ``chat_template_kwargs``
        and the like, passed to ``apply_chat_template``."""
        ids: list[int] = await self._run(
            self._chat, conversation, template_kwargs, add_special_tokens
        )
        return ids

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = await self._run(self._decode, ids, skip_special_tokens)
        return text

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        try:
            return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        except (OverflowError, TypeError, IndexError) as exc:
            raise OpenAIError(400, f"cannot decode these token ids: {exc}", param="tokens") from exc

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _chat(
        self,
        conversation: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        add_special_tokens: bool,
    ) -> list[int]:
        tokenizer = self._tokenizer
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, **template_kwargs)
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise OpenAIError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from exc
        # The template already placed any special tokens the model expects.
        return self._encode(text, add_special_tokens)
