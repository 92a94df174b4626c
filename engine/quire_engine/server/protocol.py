"""OpenAI's wire format, inbound: request models validated at the edge, and the error type.

Only this module, ``rendering`` (outbound) and ``server`` know OpenAI's JSON; behind them
everything is token ids and ``SamplingParams``. Requests accept vLLM's sampling extensions
(``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``) so the
openai client's ``extra_body`` works as with vLLM. Unknown fields are ignored (and logged), as
vLLM does, because clients send fields of newer API versions; fields whose meaning Quire cannot
honour (``echo``, ``suffix``, ``logit_bias``, ``tools``, non-text content) are rejected instead of
being dropped. Types are strict, as OpenAI's are: a string, a float or a bool where an integer
belongs is a 400, not coerced; ranges are checked by ``SamplingParams`` (the same messages offline
and over HTTP).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quire_engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Json = dict[str, Any]


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> Json:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """``defaults`` (the checkpoint's generation_config values) fill temperature, top_p,
        top_k and min_p where the request leaves them unset, as vLLM does."""
        defaults = defaults or {}
        if self.model_extra:
            logger.warning("ignored request fields: %s", ", ".join(sorted(self.model_extra)))
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        # vLLM spells "no top-k limit" as -1 (and 0); SamplingParams as None.
        top_k = defaults.get("top_k") if self.top_k is None else self.top_k
        top_k = None if top_k in (0, -1) else top_k
        kwargs: Json = {
            "n": self.n,
            "temperature": defaults.get("temperature", 1.0)
            if self.temperature is None
            else self.temperature,
            "top_p": defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
            "top_k": top_k,
            "min_p": defaults.get("min_p", 0.0) if self.min_p is None else self.min_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "max_tokens": max_tokens,
            "stop": self.stop or (),
            "stop_token_ids": self.stop_token_ids or (),
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            # SamplingParams names the field first ("temperature must be >= 0; got -1").
            field = str(exc).split(" ", 1)[0]
            param = self._wire_names.get(field, field) if field in kwargs else None
            raise OpenAIError(400, str(exc), param=param) from exc

    # SamplingParams field -> this request's field, where the two names differ.
    _wire_names: ClassVar[dict[str, str]] = {}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(400, "best_of other than n is not supported", param="best_of")
        prompt = self.prompt
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]  # one text or one list of token ids
        prompts: list[str | list[int]] = [*prompt]
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    _wire_names: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Json] | None = None
    response_format: Json | None = None
    add_generation_prompt: bool = True  # vLLM's extension

    def conversation(self) -> list[dict[str, str]]:
        if self.tools:
            raise OpenAIError(400, "tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise OpenAIError(
                400, "only response_format type 'text' is supported", param="response_format"
            )
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
