"""OpenAI's wire format, outbound: choices (full or streamed deltas) with logprobs, and usage.

Engine outputs are cumulative; ``stream_choices`` turns them into deltas. While a choice is
unfinished it holds back the last ``len(longest stop string) - 1`` characters: a stop string that
spans two tokens is cut from the text only when its last token arrives, and its first part must
not have been sent by then.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from quire_engine.core.outputs import CompletionOutput
from quire_engine.engine.request_handle import RequestHandle
from quire_engine.server.protocol import Json


def usage(prompt_tokens: int, completion_tokens: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class TokenText:
    """Token id -> its text, for logprobs (memoized: the same few thousand ids recur)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = str(self._tokenizer.decode([token_id]))
        return text


class Renderer:
    """How one endpoint spells a choice; ``tokens`` are the indices of the tokens it covers."""

    object = ""
    chunk_object = ""

    def __init__(self, tokenizer: Any) -> None:
        self.text = TokenText(tokenizer)

    def full_choice(self, index: int, sample: CompletionOutput) -> Json:
        return self.choice(index, sample.text, sample, range(len(sample.token_ids)), None)

    def choice(
        self, index: int, text: str, sample: CompletionOutput, tokens: range, stream: _Sent | None
    ) -> Json:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(
        self, index: int, text: str, sample: CompletionOutput, tokens: range, stream: _Sent | None
    ) -> Json:
        logprobs = None
        if sample.logprobs is not None:
            logprobs = self._logprobs(sample, tokens, stream.chars if stream else 0)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }

    def _logprobs(self, sample: CompletionOutput, tokens: range, offset: int) -> Json:
        """The legacy shape; ``offset`` is the character offset of the first token."""
        assert sample.logprobs is not None
        pieces, token_logprobs, tops, offsets = [], [], [], []
        for k in tokens:
            token_id, alternatives = sample.token_ids[k], sample.logprobs[k]
            piece = self.text(token_id)
            pieces.append(piece)
            token_logprobs.append(alternatives.get(token_id))
            top: dict[str, float] = {}
            for t, lp in sorted(alternatives.items(), key=lambda kv: -kv[1]):
                top.setdefault(self.text(t), lp)  # ids that decode alike keep the best
            tops.append(top)
            offsets.append(offset)
            offset += len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class ChatRenderer(Renderer):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Any, top_logprobs: int) -> None:
        super().__init__(tokenizer)
        self.top_logprobs = top_logprobs

    def choice(
        self, index: int, text: str, sample: CompletionOutput, tokens: range, stream: _Sent | None
    ) -> Json:
        logprobs = None
        if sample.logprobs is not None:
            logprobs = {"content": [self._logprob(sample, k) for k in tokens]}
        choice: Json = {"index": index}
        if stream is None:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            delta: Json = {"role": "assistant"} if stream.first else {}
            if text or stream.first:
                delta["content"] = text
            choice["delta"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = sample.finish_reason
        choice["stop_reason"] = sample.stop_reason
        return choice

    def _logprob(self, sample: CompletionOutput, k: int) -> Json:
        assert sample.logprobs is not None
        token_id, alternatives = sample.token_ids[k], sample.logprobs[k]
        ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
        item = self._entry(token_id, alternatives.get(token_id, float("-inf")))
        item["top_logprobs"] = [self._entry(t, lp) for t, lp in ranked]
        return item

    def _entry(self, token_id: int, logprob: float) -> Json:
        piece = self.text(token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


@dataclass(slots=True)
class _Sent:
    """How much of one choice has been streamed."""

    chars: int = 0
    tokens: int = 0
    first: bool = True
    done: bool = False


async def stream_choices(
    handle: RequestHandle, renderer: Renderer, n: int, holdback: int
) -> AsyncIterator[tuple[Json, int]]:
    """``(choice delta, tokens of the choice if it just finished else 0)`` as outputs arrive.
    Choice ``i`` of prompt ``p`` has index ``p * n + i``."""
    sent: dict[int, _Sent] = {}
    async for prompt_index, out in handle.outputs():
        for sample in out.outputs:
            index = prompt_index * n + sample.index
            state = sent.setdefault(index, _Sent())
            if state.done:
                continue
            finished = sample.finished
            text = sample.text
            end_char = len(text) if finished else max(state.chars, len(text) - holdback)
            end_token = len(sample.token_ids)
            delta = text[state.chars : end_char]
            logprobs_due = sample.logprobs is not None and end_token > state.tokens
            if not (delta or finished or logprobs_due):
                continue
            fresh = range(state.tokens, end_token)
            choice = renderer.choice(index, delta, sample, fresh, state)
            state.chars, state.tokens, state.first, state.done = (
                end_char,
                end_token,
                False,
                finished,
            )
            yield choice, end_token if finished else 0
