"""OpenAI's wire format, outbound: choices (full or streamed deltas) with logprobs, and usage.

Engine outputs are cumulative; ``stream_choices`` turns them into deltas. While a choice is
unfinished it holds back the last ``len(longest stop string) - 1`` characters: a stop string that
spans two tokens is cut from the text only when its last token arrives, and its first part must
not have been sent by then.

``echo`` puts the prompt before the answer: its text (and, on completions with ``logprobs``, its
tokens' logprobs, the first one ``null``) in the first chunk of each choice. Logprob keys and
bytes come from ``token_text`` (lossless for tokens that are not complete UTF-8).
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from quire_engine.core.outputs import CompletionOutput, RequestOutput
from quire_engine.engine.request_handle import RequestHandle
from quire_engine.server.choice_parser import ChoiceParser, OutputFormat
from quire_engine.server.protocol import Json
from quire_engine.server.token_text import TokenText


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(slots=True)
class Echo:
    """The prompt as ``echo`` shows it: its text, token ids and (once the engine reported them,
    when asked for) logprobs."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[dict[int, float] | None] | None = None


class Renderer:
    """How one endpoint spells a choice; ``tokens`` are the indices of the tokens it covers.
    ``echoes[p]`` is what prompt ``p`` echoes (choice ``i`` belongs to prompt ``i // n``);
    ``generated`` False drops the generated text (``echo`` with ``max_tokens`` 0)."""

    object = ""
    chunk_object = ""

    def __init__(
        self,
        text: TokenText,
        n: int = 1,
        echoes: Sequence[Echo | None] = (),
        generated: bool = True,
    ) -> None:
        self.text = text
        self.n = n
        self.echoes = echoes
        self.generated = generated
        self._cached: dict[int, int] = {}

    def observe(self, prompt_index: int, out: RequestOutput) -> None:
        """Take what a report of prompt ``prompt_index`` says about the prompt (its logprobs,
        its cached tokens) before its choices are rendered."""
        self._cached[prompt_index] = out.num_cached_tokens
        echo = self.echoes[prompt_index] if prompt_index < len(self.echoes) else None
        if echo is not None and echo.logprobs is None:
            echo.logprobs = out.prompt_logprobs

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens of the request found in the prefix cache."""
        return sum(self._cached.values())

    def echo(self, index: int) -> Echo | None:
        prompt = index // self.n
        return self.echoes[prompt] if prompt < len(self.echoes) else None

    def has_echo(self, index: int) -> bool:
        """The first chunk of choice ``index`` is due even with no new text (it echoes)."""
        return self.echo(index) is not None

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
        if not self.generated:
            text, tokens = "", range(0)
        echo = self.echo(index)
        first = stream is None or stream.first
        logprobs = None
        if sample.logprobs is not None:
            legacy = _Legacy(self.text)
            if first and echo is not None and echo.logprobs is not None:
                legacy.add(echo.token_ids, echo.logprobs, range(len(echo.token_ids)), 0)
            start = (len(echo.text) if echo is not None else 0) + (stream.chars if stream else 0)
            legacy.add(sample.token_ids, sample.logprobs, tokens, start)
            logprobs = legacy.json()
        if first and echo is not None:
            text = echo.text + text
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }


class _Legacy:
    """The completions logprobs shape, built run by run; character offsets count the complete
    characters of the tokens' bytes (a token inside a character adds none, a special token
    none: echoed and generated text are shown without special tokens)."""

    def __init__(self, text: TokenText) -> None:
        self.text = text
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, float] | None],
        which: range,
        offset: int,
    ) -> None:
        """Tokens ``which`` of a run whose first one starts at character ``offset``."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        for k in which:
            token_id, alternatives = token_ids[k], logprobs[k]
            self.tokens.append(self.text.key(token_id))
            self.text_offset.append(offset)
            offset += len(decoder.decode(self.text.shown(token_id)))
            if alternatives is None:  # the prompt's first token: nothing predicts it
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
            else:
                self.token_logprobs.append(alternatives.get(token_id))
                self.top_logprobs.append({key: lp for key, _, lp in self.text.ranked(alternatives)})

    def json(self) -> Json:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class ChatRenderer(Renderer):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        text: TokenText,
        top_logprobs: int,
        echo_text: str = "",
        n: int = 1,
        fmt: OutputFormat | None = None,
    ) -> None:
        super().__init__(text, n)
        self.top_logprobs = top_logprobs
        self.echo_text = echo_text
        self.fmt = fmt if fmt is not None and fmt.active else None
        self._parsers: dict[int, ChoiceParser] = {}  # choice index -> its parser

    def has_echo(self, index: int) -> bool:
        return bool(self.echo_text)

    def choice(
        self, index: int, text: str, sample: CompletionOutput, tokens: range, stream: _Sent | None
    ) -> Json:
        logprobs = None
        if sample.logprobs is not None:
            logprobs = {"content": [self._logprob(sample, k) for k in tokens]}
        choice: Json = {"index": index}
        parser = self._parser(index)
        if stream is None:
            message: Json = {"role": "assistant", "content": text}
            if parser is not None:
                message.update(parser.message(text))
            if self.echo_text:
                message["content"] = self.echo_text + (message["content"] or "")
            choice["message"] = message
        else:
            delta: Json = {"role": "assistant"} if stream.first else {}
            if parser is None:
                parts: Json = {"content": text} if text else {}
            else:
                upto = stream.chars + len(text)
                final = sample.finished and upto == len(sample.text)
                parts = parser.delta(sample.text[:upto], final)
            if stream.first and self.echo_text:
                parts["content"] = self.echo_text + parts.get("content", "")
            if stream.first and not parts:
                parts["content"] = ""
            delta.update(parts)
            choice["delta"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = sample.finish_reason
        if sample.finish_reason == "stop" and parser is not None and parser.has_calls:
            choice["finish_reason"] = "tool_calls"
        choice["stop_reason"] = sample.stop_reason
        return choice

    def _parser(self, index: int) -> ChoiceParser | None:
        if self.fmt is None:
            return None
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = ChoiceParser(self.fmt)
        return parser

    def _logprob(self, sample: CompletionOutput, k: int) -> Json:
        assert sample.logprobs is not None
        token_id, alternatives = sample.token_ids[k], sample.logprobs[k]
        item = self._entry(self.text.key(token_id), token_id, alternatives.get(token_id, -9999.0))
        ranked = self.text.ranked(alternatives, self.top_logprobs)
        item["top_logprobs"] = [self._entry(key, t, lp) for key, t, lp in ranked]
        return item

    def _entry(self, key: str, token_id: int, logprob: float) -> Json:
        return {"token": key, "logprob": logprob, "bytes": list(self.text.raw(token_id))}


def prompt_logprobs_json(
    text: TokenText, logprobs: Sequence[dict[int, float] | None] | None
) -> list[Json | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, token id -> logprob and decoded token."""
    if logprobs is None:
        return None
    return [
        None
        if entry is None
        else {str(t): {"logprob": lp, "decoded_token": key} for key, t, lp in text.ranked(entry)}
        for entry in logprobs
    ]


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
        renderer.observe(prompt_index, out)
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
            due = delta or finished or logprobs_due
            if not (due or (state.first and renderer.has_echo(index))):
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
