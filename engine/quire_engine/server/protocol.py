"""OpenAI's wire format, inbound: request models validated at the edge, and the error type.

Only this module, ``rendering`` (outbound) and ``server`` know OpenAI's JSON; behind them
everything is token ids and ``SamplingParams``. Requests accept vLLM's sampling extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``allowed_token_ids``,
``bad_words``, ``prompt_logprobs``, ``ignore_eos``, ``stop_token_ids``, ``use_beam_search``, ...)
so the openai client's ``extra_body`` works as with vLLM. Every field is honoured or refused:
vLLM fields Quire has not built are a 400 naming them (``vllm_fields``), and unknown fields are
accepted and logged, as vLLM does, because clients send fields of newer API versions. Types are
strict, as OpenAI's are: a string, a float or a bool where an integer belongs is a 400, not
coerced; ranges are checked by ``SamplingParams`` (the same messages offline and over HTTP).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quire_engine.core.constraint import OutputConstraint
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.server.structured_fields import ConstraintError, output_constraint
from quire_engine.server.vllm_fields import check_extra

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


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    model_config = ConfigDict(strict=True)

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and unused:
    the name identifies the adapter)."""

    model_config = ConfigDict(strict=True)

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


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
    repetition_penalty: float | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    return_tokens_as_token_ids: bool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs.
    response_format: Json | None = None
    structured_outputs: Json | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def check_fields(self) -> None:
        """400 for fields Quire refuses (see ``vllm_fields``); unknown ones are logged."""
        check_extra(self.model_extra, refused)
        if self.length_penalty != 1.0:
            raise refused("length_penalty")

    def constraint(self) -> tuple[OutputConstraint, str] | None:
        """What the output must match and the field that asked, or None (400 for a malformed
        ``response_format`` or ``structured_outputs``)."""
        try:
            return output_constraint(self.response_format, self.structured_outputs)
        except ConstraintError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc

    @property
    def beam_width(self) -> int | None:
        """``use_beam_search``: vLLM's beam search over HTTP, ``n`` beams."""
        return self.n if self.use_beam_search else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: Mapping[str, Any] | None = None,
        prompt_logprobs: int | None = None,
        constraint: OutputConstraint | None = None,
    ) -> SamplingParams:
        """``defaults`` (the checkpoint's generation_config values) fill temperature, top_p,
        top_k, min_p and repetition_penalty where the request leaves them unset, as vLLM does.
        ``prompt_logprobs`` stands in for the request's own (``echo`` with ``logprobs``)."""
        defaults = defaults or {}
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        logit_bias = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise OpenAIError(
                    400, f"logit_bias keys must be token ids; got {key!r:.40}", param="logit_bias"
                )
            logit_bias[int(key)] = bias
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
            "repetition_penalty": defaults.get("repetition_penalty", 1.0)
            if self.repetition_penalty is None
            else self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "logit_bias": logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words or (),
            "prompt_logprobs": prompt_logprobs,
            "constraint": constraint,
        }
        if self.use_beam_search:
            self._check_beam(kwargs)
            # Beam search ranks by log-probability: vLLM's beams ignore the sampling filters.
            kwargs.update(n=1, temperature=0.0, top_p=1.0, top_k=None, min_p=0.0)
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            # SamplingParams names the field first ("temperature must be >= 0; got -1").
            field = str(exc).split(" ", 1)[0]
            param = self._wire_names.get(field, field) if field in kwargs else None
            raise OpenAIError(400, str(exc), param=param) from exc

    def _check_beam(self, kwargs: Json) -> None:
        """Beam search ranks whole beams by log-probability and ends them at EOS or length: the
        per-token controls have no meaning there, so asking for them is a 400."""
        beam_free = ("logprobs", "prompt_logprobs", "allowed_token_ids", "constraint")
        unused = [k for k in beam_free if kwargs[k] is not None]
        unused += [
            k
            for k in ("stop", "stop_token_ids", "bad_words", "logit_bias", "min_tokens")
            if kwargs[k]
        ]
        if unused:
            name = self._wire_names.get(unused[0], unused[0])
            raise OpenAIError(400, f"{name} is not supported with use_beam_search", param=name)

    # SamplingParams field -> this request's field, where the two names differ.
    _wire_names: ClassVar[dict[str, str]] = {"constraint": "structured_outputs"}


def refused(name: str) -> OpenAIError:
    return OpenAIError(400, f"{name} is not supported by this server", param=name)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt (and its logprobs) and nothing generated;
        the engine still runs one step, whose token is dropped (as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        self.check_fields()
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(
                400, "max_tokens must be >= 1 unless echo is true", param="max_tokens"
            )
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


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A call in an assistant message of the conversation."""

    model_config = ConfigDict(strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def for_template(self) -> Json:
        arguments: Any = self.function.arguments
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        call: Json = {"type": "function", "function": {"name": self.function.name}}
        call["function"]["arguments"] = arguments
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # the assistant's
    tool_call_id: str | None = None  # a tool's answer names the call

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def for_template(self) -> Json:
        """The message as chat templates read it (transformers' convention): the calls'
        arguments as objects where they are JSON objects (templates write them with tojson)."""
        message: Json = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(SamplingRequest):
    _wire_names: ClassVar[dict[str, str]] = {
        "logprobs": "top_logprobs",
        "constraint": "structured_outputs",
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Json] | None = None
    tool_choice: str | Json | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Json | None = None
    documents: list[Json] | None = None
    include_reasoning: bool = True

    def conversation(self) -> list[Json]:
        self.check_fields()
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise OpenAIError(
                400, "continue_final_message needs a final assistant message", param="messages"
            )
        return [m.for_template() for m in self.messages]

    def template_kwargs(self) -> Json:
        """Keyword arguments for the chat template besides the conversation."""
        kwargs: Json = dict(self.chat_template_kwargs or {})
        clash = sorted(set(kwargs) & _TEMPLATE_RESERVED)
        if clash:
            raise OpenAIError(
                400,
                f"chat_template_kwargs may not set {', '.join(clash)}",
                param="chat_template_kwargs",
            )
        kwargs["add_generation_prompt"] = self.add_generation_prompt
        kwargs["continue_final_message"] = self.continue_final_message
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.tools:
            kwargs["tools"] = self.tools
        return kwargs

    @property
    def enable_thinking(self) -> bool:
        """``chat_template_kwargs.enable_thinking`` (default true): false turns the reasoning
        parser off for this request, as the template then writes no thinking."""
        return (self.chat_template_kwargs or {}).get("enable_thinking") is not False

    @property
    def echo_text(self) -> str:
        """What ``echo`` prefixes the answer with: the last message when it is the assistant's
        (the answer continues it), else nothing (vLLM's rule)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

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


# Arguments of apply_chat_template that request fields own.
_TEMPLATE_RESERVED = frozenset(
    {"conversation", "tokenize", "return_dict", "tools", "add_generation_prompt",
     "continue_final_message", "chat_template", "documents", "tokenizer_kwargs"}
)  # fmt: skip
