"""The synchronous engine loop: requests in, one scheduler step -> model step -> sampling per call.

``LLMEngine`` owns the scheduler (control side), the model runner (tensor side) and every request's
sampling state. ``step()`` returns the outputs of the requests that progressed. The offline ``LLM``
and the async server are thin layers over it.

Sequences and requests: a request has one sample stream per ``n``; all but the first are forked
from the first once its prompt is computed, so the prompt's blocks are shared (copy-on-write on
the partially filled last block). Beam search (see ``beam_search``) forks and prunes beams the
same way. Every exit (stop, length, abort, rejection) goes through ``Scheduler.finish``, which
returns the sequence's blocks.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from quire_engine import beam_search, model_loader
from quire_engine.config import CacheConfig, EngineConfig, PreemptionMode, SchedulerConfig
from quire_engine.detokenizer import Detokenizer, find_stop
from quire_engine.model_runner import CacheShape, ModelRunner, profile_peak_memory, size_pool
from quire_engine.outputs import CompletionOutput, RequestOutput
from quire_engine.sampler import SampleRow, sample
from quire_engine.sampling_params import SamplingParams
from quire_engine.scheduler import Scheduler
from quire_engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sample:
    """One output stream of a request: its sequence, RNG, detokenizer and output so far."""

    seq: Sequence
    generator: torch.Generator | None
    detok: Detokenizer
    output: CompletionOutput


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    beam: beam_search.BeamState | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        samples = self.samples
        if len(samples) == 1:  # the common case, once per request per step
            return self.params.n == 1 and samples[0].output.finish_reason is not None
        return len(samples) == self.params.n and all(s.output.finished for s in samples)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = model_loader.resolve_device(config.device)
        self.dtype = model_loader.resolve_dtype(config.dtype, self.device)
        loaded = model_loader.load(config.model, self.device, self.dtype)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.vocab_size = int(getattr(loaded.model.config, "vocab_size"))  # noqa: B009
        max_len = config.max_model_len or loaded.max_position_embeddings
        if max_len > loaded.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{loaded.max_position_embeddings}"
            )
        if loaded.sliding_window is not None and max_len > loaded.sliding_window:
            raise ValueError(
                f"the model uses sliding-window attention (window {loaded.sliding_window}) and "
                f"Quire implements full attention: set max_model_len <= {loaded.sliding_window}"
            )
        self.max_model_len = max_len
        batched = config.max_num_batched_tokens or max(2048, min(max_len, 8192))
        shape = CacheShape.of(loaded.model, config.block_size, self.dtype)
        explicit = config.num_blocks is not None or config.kv_cache_memory is not None
        peak = None
        if self.device.type == "cuda" and not explicit:
            peak = profile_peak_memory(loaded.model, batched, config.max_num_seqs, self.device)
        num_blocks = size_pool(
            shape=shape,
            device=self.device,
            num_blocks=config.num_blocks,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            profile_peak_bytes=peak,
            min_tokens=max_len,
        )
        num_cpu_blocks = 0
        if config.preemption_mode is PreemptionMode.SWAP:
            num_cpu_blocks = int(config.swap_space * 2**30) // shape.bytes_per_block
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, batched, max_len, config.preemption_mode),
            CacheConfig(
                num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks
            ),
        )
        self.runner = ModelRunner(
            loaded.model,
            shape,
            num_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
            device=self.device,
        )
        logger.info(
            "KV pool: %d blocks x %d tokens (%.1f MiB), %d CPU swap blocks, max_model_len %d",
            num_blocks,
            config.block_size,
            num_blocks * shape.bytes_per_block / 2**20,
            num_cpu_blocks,
            max_len,
        )
        self._requests: dict[str, _Request] = {}
        self._owner: dict[str, tuple[_Request, _Sample]] = {}
        self._rng = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, list(self.tokenizer(prompt).input_ids)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        beam_width: int | None = None,
    ) -> None:
        """Queue a request; ``ValueError`` (nothing held) for bad input or one that cannot fit."""
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids = self.tokenize(prompt)
        req = _Request(request_id, text, ids, params)
        seq = Sequence(f"{request_id}/0", ids, max_tokens=params.max_tokens, cache_salt=cache_salt)
        self.scheduler.add(seq)  # validates length and pool fit
        if beam_width is not None:
            req.beam = beam_search.BeamState(beam_width, ignore_eos=params.ignore_eos)
            req.beam.active.append(seq.seq_id)
        self._requests[request_id] = req
        self._new_sample(req, seq, index=0)

    def _new_sample(
        self, req: _Request, seq: Sequence, index: int, generator: torch.Generator | None = None
    ) -> _Sample:
        """Register a sample stream; its output starts empty (tokens arrive via _emit_token)."""
        params = req.params
        if generator is None:
            generator = self._fork_generator(req, index)
        want_lp = params.logprobs is not None
        out = CompletionOutput(
            index=index,
            cumulative_logprob=0.0 if want_lp or req.beam is not None else None,
            logprobs=[] if want_lp else None,
        )
        sample_ = _Sample(seq, generator, Detokenizer(self.tokenizer, req.prompt_token_ids), out)
        req.samples.append(sample_)
        self._owner[seq.seq_id] = (req, sample_)
        return sample_

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state and free its blocks. Unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for s in req.samples:
            self.scheduler.finish(s.seq, "abort")
            self._owner.pop(s.seq.seq_id, None)
            if s.output.finish_reason is None:
                s.output.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward pass; outputs of the requests that progressed."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        logits = self.runner.execute(out)  # [num_sampling_seqs, vocab]

        # This loop runs once per sequence per step (hundreds per step): plain locals, and the
        # n > 1 fan-out is the only case that leaves the one-row-per-sequence shape.
        owner = self._owner
        rows: list[SampleRow] = []
        row_index: list[int] = []
        targets: list[tuple[_Request, _Sample, int]] = []  # (request, parent sample, sample idx)
        beam_rows: list[tuple[_Request, Sequence, int]] = []
        fanned_out = False
        i = 0
        for seq, sampled in zip(out.seqs, out.samples, strict=True):
            if not sampled:
                continue
            req, smp = owner[seq.seq_id]
            if req.beam is not None:
                beam_rows.append((req, seq, i))
            elif req.params.n > 1 and len(req.samples) == 1 and not seq.output_token_ids:
                fanned_out = True
                for j in range(req.params.n):
                    gen = smp.generator if j == 0 else self._fork_generator(req, j)
                    rows.append(SampleRow(req.params, gen, seq.output_token_ids))
                    row_index.append(i)
                    targets.append((req, smp, j))
            else:
                rows.append(SampleRow(req.params, smp.generator, seq.output_token_ids))
                row_index.append(i)
                targets.append((req, smp, 0))
            i += 1

        touched: dict[str, _Request] = {}
        result = None
        if rows:
            # One row per sampling sequence (no fan-out, no beam) needs no gather.
            plain = not fanned_out and not beam_rows
            result = sample(logits if plain else logits[row_index], rows)
        tokens = result.token_ids if result is not None else []
        primary = {
            smp.seq.seq_id: tok for (_, smp, j), tok in zip(targets, tokens, strict=True) if j == 0
        }
        self.scheduler.update(out, primary)
        if result is not None:
            # Fork every new sample before any stop check can finish (and free) its parent.
            streams = [
                smp if j == 0 else self._fork_sample(req, smp, j, tok, rows[k].generator)
                for k, ((req, smp, j), tok) in enumerate(zip(targets, tokens, strict=True))
            ]
            logprobs, top = result.logprobs, result.top_logprobs
            for k, ((req, _, _), stream) in enumerate(zip(targets, streams, strict=True)):
                self._emit_token(
                    req,
                    stream,
                    tokens[k],
                    logprobs[k] if logprobs is not None else None,
                    top[k] if top is not None else None,
                )
                touched[req.request_id] = req
        for req, seq, i in beam_rows:
            if req.request_id in self._requests:
                self._beam_logits(req, seq, logits[i])
                touched[req.request_id] = req
        return [self._output(req) for req in touched.values()]

    def _fork_generator(self, req: _Request, j: int) -> torch.Generator | None:
        """Sample ``j``'s own RNG: ``seed + j`` when seeded (reproducible whatever the batch),
        else drawn from the engine's RNG. Greedy samples need none."""
        if req.params.greedy or req.beam is not None:
            return None
        seed = req.params.seed
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.device).manual_seed(seed + j)

    def _fork_sample(
        self, req: _Request, parent: _Sample, j: int, token: int, gen: torch.Generator | None
    ) -> _Sample:
        """Sample ``j`` of an n > 1 request: shares the parent's prompt blocks (fork) and starts
        from its own first token, drawn with its own generator ``gen``."""
        child = parent.seq.fork(f"{req.request_id}/{j}")
        child.replace_last_token(token)
        if parent.seq.is_finished:
            child.status = parent.seq.status  # max_tokens == 1: done before it ever runs
            child.finish_reason = parent.seq.finish_reason
        else:
            self.scheduler.fork(parent.seq, child)
        return self._new_sample(req, child, j, generator=gen)

    def _emit_token(
        self,
        req: _Request,
        smp: _Sample,
        token: int,
        logprob: float | None,
        top: dict[int, float] | None,
    ) -> None:
        out = smp.output
        params = req.params
        out.token_ids.append(token)
        if logprob is not None and out.cumulative_logprob is not None:
            out.cumulative_logprob += logprob
        if out.logprobs is not None and top is not None:
            out.logprobs.append(top)
        new_text = smp.detok.add(token)
        reason: str | None = None
        stop_reason: str | int | None = None
        if token == self.eos_token_id and not params.ignore_eos:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif params.stop and new_text:
            hit = find_stop(smp.detok.text, len(new_text), params.stop)
            if hit is not None:
                idx, stop = hit
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                smp.detok.text = smp.detok.text[:end]
                reason, stop_reason = "stop", stop
        out.text = smp.detok.text
        if reason is not None:
            self.scheduler.finish(smp.seq, reason)
            out.finish_reason, out.stop_reason = reason, stop_reason
        elif smp.seq.is_finished:
            out.finish_reason = smp.seq.finish_reason

    def _beam_logits(self, req: _Request, seq: Sequence, logits: torch.Tensor) -> None:
        state = req.beam
        assert state is not None
        state.pending[seq.seq_id] = torch.log_softmax(logits, dim=-1).cpu()
        if not state.ready:
            return
        beam_search.advance(self, req, state)

    def _output(self, req: _Request) -> RequestOutput:
        finished = req.finished
        if finished:
            self._requests.pop(req.request_id, None)
            for s in req.samples:
                self._owner.pop(s.seq.seq_id, None)
        if req.beam is not None:
            outputs = beam_search.outputs(self, req.beam) if finished else []
        elif len(req.samples) == 1:
            outputs = [_copy(req.samples[0].output)]
        else:
            outputs = [_copy(s.output) for s in sorted(req.samples, key=lambda s: s.output.index)]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outputs,
            finished=finished,
        )


def _copy(out: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(  # positional: this runs once per sequence per step
        out.index,
        out.text,
        out.token_ids[:],
        out.cumulative_logprob,
        out.logprobs[:] if out.logprobs is not None else None,
        out.finish_reason,
        out.stop_reason,
    )
