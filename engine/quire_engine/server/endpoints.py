"""The OpenAI endpoints (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) and the
token endpoints (``/tokenize``, ``/detokenize``): request admission, tokenization, structured
output compilation, then one submitted job per request (:mod:`.job`).

Ownership: one :class:`Endpoints` per app owns the prompt encoder (tokenization and chat
templates on one worker thread, so a large body never blocks the event loop) and the grammar
compiler's thread; ``close()`` (the app's lifespan calls it) stops both. Each request owns the
``RequestHandle`` it submitted, through its job.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from quire_engine.core.constraint import OutputConstraint
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.async_engine import AsyncEngine
from quire_engine.engine.engine_thread import ModelInfo
from quire_engine.engine.request_handle import EngineUnavailable
from quire_engine.server import tokens_api
from quire_engine.server.adapters import AdapterRegistry
from quire_engine.server.choice_parser import OutputFormat
from quire_engine.server.errors import unavailable
from quire_engine.server.job import Job, abort_on_disconnect, respond, stream
from quire_engine.server.prompt_encoder import PromptEncoder
from quire_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Json,
    LoadLoRAAdapterRequest,
    OpenAIError,
    SamplingRequest,
    UnloadLoRAAdapterRequest,
)
from quire_engine.server.reasoning import ReasoningParserName
from quire_engine.server.rendering import ChatRenderer, CompletionRenderer, Echo, Renderer
from quire_engine.server.token_text import TokenText
from quire_engine.server.tool_choice import ToolSettings, plan

# Fields the engine validates against itself (max_num_seqs, the vocabulary): its ValueError
# names one of them first, and the 400 names it as the param.
ENGINE_CHECKED = frozenset({"n", "stop_token_ids", "allowed_token_ids", "logit_bias", "beam_width"})


class Endpoints:
    """The endpoints' handlers; one instance per app (see the module docstring).

    ``served_model_names``: the names requests may ask for, the first one names responses.
    ``tools``: ``--enable-auto-tool-choice`` and ``--tool-call-parser``; ``reasoning_parser``:
    how chat outputs' thinking is split off."""

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: tuple[str, ...],
        tools: ToolSettings,
        reasoning_parser: ReasoningParserName | None,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.adapters = adapters or AdapterRegistry(engine, served_model_names)
        self.tools = tools
        self.reasoning_parser = reasoning_parser
        self.created = int(time.time())
        self._encoder: PromptEncoder | None = None
        # Grammars compile here, never on the event loop or the engine's step loop.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="quire-grammar")

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.close()
        self._compiler.shutdown(wait=False, cancel_futures=True)

    async def constraint(self, body: SamplingRequest, info: ModelInfo) -> OutputConstraint | None:
        """The request's structured-output constraint, compiled (a cache hit for one seen
        before); a 400 with the compiler's message when it does not compile."""
        asked = body.constraint()
        if asked is None:
            return None
        return await self.compile(*asked, info)

    async def compile(
        self, constraint: OutputConstraint, param: str, info: ModelInfo
    ) -> OutputConstraint:
        if info.grammars is None:
            raise OpenAIError(400, "structured outputs are off on this server", param=param)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._compiler, info.grammars.compile, constraint)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=param) from exc
        return constraint

    def encoder(self, info: ModelInfo) -> PromptEncoder:
        if self._encoder is None:
            self._encoder = PromptEncoder(info.tokenizer)
        return self._encoder

    async def models(self) -> Json:
        info = self.engine.info
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "quire",
                "root": info.model_name if info else None,
                "max_model_len": info.max_model_len if info else None,
                "kv_cache_dtype": info.kv_cache_dtype if info else None,
            }
            for name in self.served_model_names
        ]
        cards += [
            {
                "id": lora.name,
                "object": "model",
                "created": self.created,
                "owned_by": "quire",
                "root": lora.source,
                "parent": self.served_model_names[0],
                "max_model_len": info.max_model_len if info else None,
            }
            for lora in self.adapters.served()
        ]
        return {"object": "list", "data": cards}

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        try:
            return PlainTextResponse(await self.adapters.load(body.lora_name, body.lora_path))
        except EngineUnavailable as exc:  # not ready, draining or dead: a 503, as everywhere
            raise unavailable(exc) from exc

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        try:
            return PlainTextResponse(await self.adapters.unload(body.lora_name))
        except EngineUnavailable as exc:
            raise unavailable(exc) from exc

    async def tokenize(self, body: tokens_api.TokenizeRequest) -> Json:
        info = self._model(body.model)
        return await tokens_api.tokenize(
            body, self.encoder(info), info.tokenizer, info.max_model_len
        )

    async def detokenize(self, body: tokens_api.DetokenizeRequest) -> Json:
        info = self._model(body.model)
        return await tokens_api.detokenize(body, self.encoder(info), info.vocab_size)

    def _model(self, model: str | None) -> ModelInfo:
        """The model's info for a request naming ``model`` (404 for another name, 503 while
        the engine is not ready)."""
        self._check_model(model)
        error = self.engine.not_ready()
        if error is not None:
            raise unavailable(error)
        assert self.engine.info is not None
        return self.engine.info

    def _check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the base model (one of its names) or a served adapter."""
        self.adapters.resolve(model)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        texts = body.prompts()
        info = self._admit(body, len(texts))
        encoder = self.encoder(info)
        prompts = [await encoder.prompt(text, body.add_special_tokens) for text in texts]
        # echo with logprobs shows the prompt's logprobs too (vLLM's rule).
        echo_logprobs = body.logprobs if body.echo else None
        requested = 1 if body.echo_only else body.max_tokens
        constraint = await self.constraint(body, info)
        params = [
            body.sampling_params(
                _max_tokens(info, len(p), requested, "prompt"),
                body.logprobs,
                info.sampling_defaults,
                prompt_logprobs=echo_logprobs,
                constraint=constraint,
            )
            for p in prompts
        ]
        echoes: list[Echo | None] = []
        if body.echo:
            for text, ids in zip(texts, prompts, strict=True):
                shown = text if isinstance(text, str) else await encoder.decode(ids, True)
                echoes.append(Echo(shown, ids))
        renderer = CompletionRenderer(
            TokenText(info.tokenizer, body.return_tokens_as_token_ids),
            body.n,
            echoes,
            generated=not body.echo_only,
        )
        return await self._generate(request, body, "cmpl", prompts, params, renderer, arrival)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        conversation = body.conversation()
        template_kwargs = body.template_kwargs()
        num_logprobs = body.num_logprobs
        info = self._admit(body, 1)
        if not info.tokenizer.chat_template and body.chat_template is None:
            # No fallback: another model's template would silently produce the wrong format.
            raise OpenAIError(
                400,
                "the model's tokenizer has no chat template; use /v1/completions, or start the "
                "server with --chat-template",
                param="messages",
            )
        tools = plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.tools)
        if body.tools:
            template = body.chat_template or info.tokenizer.chat_template
            if "tools" not in str(template):
                raise OpenAIError(
                    400,
                    "the chat template does not render tools; start the server with a "
                    "--chat-template that does, or send one in chat_template",
                    param="tools",
                )
        prompt = await self.encoder(info).chat(
            conversation, template_kwargs, body.add_special_tokens
        )
        max_tokens = _max_tokens(info, len(prompt), body.requested_max_tokens, "messages")
        constraint = await self.constraint(body, info)
        if tools.constraint is not None:
            if constraint is not None:
                raise OpenAIError(
                    400,
                    f"tool_choice {tools.mode} does not combine with response_format or "
                    "structured_outputs",
                    param="tool_choice",
                )
            constraint = await self.compile(tools.constraint, "tools", info)
        reasoning = self.reasoning_parser if body.enable_thinking else None
        fmt = OutputFormat(
            reasoning,
            body.include_reasoning,
            tools.parser,
            tools.max_calls,
            forced=tools.constraint is not None,
        )
        params = [
            body.sampling_params(
                max_tokens, num_logprobs, info.sampling_defaults, constraint=constraint
            )
        ]
        renderer = ChatRenderer(
            TokenText(info.tokenizer, body.return_tokens_as_token_ids),
            num_logprobs or 0,
            body.echo_text,
            body.n,
            fmt,
        )
        return await self._generate(request, body, "chatcmpl", [prompt], params, renderer, arrival)

    def _admit(self, body: SamplingRequest, num_prompts: int) -> ModelInfo:
        self._check_model(body.model)
        limit = self.engine.max_waiting
        if limit is not None and num_prompts > limit:
            raise OpenAIError(
                400,
                f"at most {limit} prompts per request (max_waiting); got {num_prompts}",
                param="prompt",
            )
        try:
            return self.engine.check_admission(num_prompts)
        except EngineUnavailable as exc:
            raise unavailable(exc) from exc

    async def _generate(
        self,
        request: Request,
        body: SamplingRequest,
        prefix: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        renderer: Renderer,
        arrival: float,
    ) -> Response:
        # vLLM's order: the X-Request-Id header (a gateway sets one per request and logs it),
        # then the body's request_id, then a fresh one.
        given = request.headers.get("x-request-id") or body.request_id
        request_id = f"{prefix}-{given or uuid.uuid4().hex}"
        lora = self.adapters.resolve(body.model)
        try:
            handle = await self.engine.submit(
                request_id,
                prompts,
                params,
                arrival=arrival,
                beam_width=body.beam_width,
                cache_salt=body.cache_salt,
                lora_request=lora,
            )
        except ValueError as exc:  # the engine's checks name the field first
            field = re.match(r"[a-z_]+", str(exc))
            param = field.group() if field and field.group() in ENGINE_CHECKED else "prompt"
            if "duplicate request id" in str(exc):
                param = "request_id"
            raise OpenAIError(400, str(exc), param=param) from exc
        except EngineUnavailable as exc:
            raise unavailable(exc) from exc
        head = {"id": request_id, "created": int(time.time())}
        head["model"] = lora.lora_name if lora is not None else self.served_model_names[0]
        job = Job(
            handle=handle,
            watcher=asyncio.create_task(abort_on_disconnect(request, handle)),
            renderer=renderer,
            head=head,
            n=body.n,
            num_prompt_tokens=sum(len(p) for p in prompts),
        )
        if not body.stream:
            return await respond(job)
        holdback = max((len(stop) for stop in params[0].stop), default=1) - 1
        return StreamingResponse(
            stream(job, body.include_usage, holdback),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


def _max_tokens(info: ModelInfo, num_prompt: int, requested: int | None, param: str) -> int:
    """``requested`` checked against the context (vLLM's wording); None means "the rest of it"."""
    limit = info.max_model_len
    if num_prompt >= limit:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input.",
            param=param,
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - num_prompt
    if num_prompt + requested > limit:
        raise OpenAIError(
            400,
            f"'max_tokens' is too large: {requested}. This model's maximum context length is "
            f"{limit} tokens and your request has {num_prompt} input tokens "
            f"({requested} > {limit} - {num_prompt}).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested
