"""The engine's native CPU kernels in C, compiled on first use into one shared library:

* ``csrc/paged_decode.c``: paged decode attention. On CPU the torch path has to gather a
  sequence's scattered blocks into a contiguous, padded copy before SDPA can read them, so
  decode attention moves each K/V byte three times (read, write, read again) and pays for
  padding; the kernel reads the blocks where they lie, once (vLLM's CPU backend does the same
  with C++ kernels; on CUDA the Triton kernel does it). It reads float32 pools and the 8-bit
  ones of ``--kv-cache-dtype`` (int8, fp8 e4m3fn and e5m2, with their scales), the latter
  widened in registers (``csrc/kv_quant.h``): a quarter of the bytes.
* ``csrc/skinny_linear.c``: ``nn.Linear`` for a few rows (small-batch decode), where a BLAS
  sgemm's packing of the weight doubles the memory traffic that bounds the call
  (``linear_cpu`` routes the calls).
* ``csrc/decoder_decode.c``: a whole decode step of a few sequences of a Llama-shaped model in
  one call, built on the two kernels above (``decoder`` checks the model and drives it):
  at a few rows the module-by-module forward pays per-op dispatch that this call does not.
* ``csrc/kv_quant.c``: ``kernels/kv_quant``'s write rule (quantizing a K/V row into 8 bits
  and its scale), byte for byte: the decode step above writes its new tokens with it
  (``KvQuantize`` exposes it to the tests).

``csrc/quire_native.h`` declares every kernel's entry point and the math they share;
``csrc/kv_quant.h`` how 8-bit elements are read.

Build and cache (the same approach as Triton's launchers and torch's inline extensions):

* the sources are compiled with the C compiler in ``$CC`` (else ``cc``, else ``gcc``) with
  ``-O3 -march=native`` and OpenMP when the compiler has it (without it the kernels run on one
  thread); each flag set is tried in turn until one builds;
* the shared object is cached under ``$QUIRE_KERNEL_CACHE`` (default
  ``$XDG_CACHE_HOME/quire/kernels``, i.e. ``~/.cache/quire/kernels``), named by a hash of the
  sources, the compiler's version, the flags and this CPU's model and feature flags, so a cache
  shared by machines of different CPU types never loads code built for another one; it is
  written to a temporary name and renamed, so concurrent first starts cannot load half a file;
* ``QUIRE_NATIVE_KERNELS=0`` turns them off. Without a compiler, or when the build fails, the
  engine logs one warning and runs the torch paths: slower, same results to rounding.

Contract. This module owns the compiled library (one per process, loaded once). The C code
trusts what it is given; Python checks it first: ``PagedDecode``, ``KvQuantize`` and
``SkinnyLinear`` check every tensor's dtype, shape and strides before a pointer crosses into C
(``SkinnyLinear.launch`` skips them for ``linear``'s router, which checks what it needs
itself); the callers (``CpuAttentionPlan``, ``linear``, ``decoder.DecoderStack``) own the index
arrays and the routing and check that every index stays inside its pool, table or embedding.
At load,
``DecoderDecode`` checks that the library's layer table and argument struct
(``csrc/quire_native.h``) are the ones ``LAYER_FIELDS`` and ``DecoderArgs`` describe, by name,
and refuses the library otherwise. Return codes of the C entry points become exceptions here:
``MemoryError`` (scratch allocation failed), ``RuntimeError`` (a table that disagrees).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quire_engine.cpu.decoder_abi import DecoderArgs as DecoderArgs  # users name it native.*
from quire_engine.cpu.decoder_abi import DecoderDecode

logger = logging.getLogger(__name__)


_CSRC = Path(__file__).with_name("csrc")
# One library, built together; HEADERS are part of its identity (the cache key).
SOURCES = (
    _CSRC / "paged_decode.c", _CSRC / "skinny_linear.c", _CSRC / "decoder_decode.c",
    _CSRC / "kv_quant.c",
)  # fmt: skip
HEADERS = (_CSRC / "quire_native.h", _CSRC / "kv_quant.h")
# Tried in order; the first that compiles is used. OpenMP lets a step's sequences spread over
# torch's thread count; -march=native turns on the CPU's vector units (AVX2/AVX-512/NEON).
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-march=native", "-fopenmp"),
    ("-march=native", "-fopenmp-simd"),
    ("-fopenmp-simd",),
    (),
)
# The environment variables this module reads (QUIRE_* names that are not serve flags; the
# Dockerfile test checks every QUIRE_* variable the image sets against serve flags and these).
ENV_VARS = ("QUIRE_KERNEL_CACHE", "QUIRE_NATIVE_KERNELS")
_BASE_FLAGS = ("-O3", "-fno-trapping-math", "-shared", "-fPIC", "-std=c11")
_P = ctypes.c_void_p
_I = ctypes.c_int64
# Pool element dtype -> enum quire_kv_kind (csrc/quire_native.h): every kernel's kinds, and
# those of the paged decode kernel alone, which also reads a bf16 model's bfloat16 pool (the
# whole-step decoder and the quantizer take fp32 activations only).
KV_KINDS = {torch.float32: 0, torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
PAGED_KV_KINDS = {**KV_KINDS, torch.bfloat16: 4}
# The pool dtypes with no scales beside them.
UNSCALED_KV = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    """Whether ``QUIRE_NATIVE_KERNELS`` allows the native kernel (anything but 0/false/off/no)."""
    value = os.environ.get("QUIRE_NATIVE_KERNELS", "1").strip().lower()
    return value not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    explicit = os.environ.get("QUIRE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "quire" / "kernels"


def compiler() -> str | None:
    """The C compiler to use: ``$CC`` when set (even if missing: then None), else cc or gcc."""
    explicit = os.environ.get("CC")
    if explicit:
        return shutil.which(explicit)
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    # The model name and feature flags: what -march=native compiles for.
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = {ln.split(":", 1)[0].strip(): ln for ln in text.splitlines() if ":" in ln}
    return "\n".join(lines.get(w, "") for w in wanted)


def _version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _build(cc: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile ``SOURCES`` into ``target`` atomically; None on success, else the compiler's
    complaint."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    os.close(fd)
    try:
        cmd = [cc, *_BASE_FLAGS, *flags, *map(str, SOURCES), "-o", tmp, "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip()[-2000:] or f"exit {done.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass(frozen=True, slots=True)
class Library:
    """The loaded shared object of every native kernel, with where it lies and the flags that
    built it."""

    cdll: ctypes.CDLL
    path: Path
    flags: tuple[str, ...]


class PagedDecode:
    """The loaded ``quire_paged_decode`` symbol with its checked Python signature."""

    def __init__(self, lib: Library) -> None:
        self.path = lib.path
        self.flags = lib.flags
        fn = lib.cdll.quire_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I]
        fn.argtypes += [ctypes.c_float, _I, ctypes.c_float, _P, _I]
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,  # [T, heads, D] fp32, D contiguous
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D] fp32/bf16/8-bit, contiguous
        v_cache: torch.Tensor,
        rows: np.ndarray,  # int64 [n]
        tables: np.ndarray,  # int32 [n, W], C-contiguous
        lens: np.ndarray,  # int64 [n]
        scale: float,
        out: torch.Tensor,  # [T, heads, D] fp32, contiguous
        num_threads: int = 1,
        sliding_window: int | None = None,
        softcap: float | None = None,
        k_scale: torch.Tensor | None = None,  # 8-bit pools: fp32 [num_blocks, block_size, kv_heads]
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write rows ``rows`` of ``out``. The caller guarantees each ``lens[i]`` is in
        ``1 .. W * block_size``, each used block id is in the pool and each row is below T.
        ``sliding_window``: each query sees its last that many positions; ``softcap``: scores
        are ``softcap * tanh(scale * q.k / softcap)``. An 8-bit pool (int8, float8_e4m3fn,
        float8_e5m2) comes with its scales (``kernels/kv_quant``), read in place."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if softcap is not None and not 0.0 < softcap < float("inf"):
            raise ValueError(f"softcap must be positive and finite, got {softcap}")
        n = len(rows)
        _, heads, head_dim = q.shape
        _, block_size, kv_heads, kv_dim = k_cache.shape
        kind = PAGED_KV_KINDS.get(k_cache.dtype)
        if q.dtype != torch.float32 or kind is None:
            raise ValueError(
                f"native decode needs fp32 q and fp32, bf16 or 8-bit K/V, got "
                f"{q.dtype}/{k_cache.dtype}"
            )
        if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError("native decode: K and V pools differ in shape or dtype")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("native decode needs contiguous K/V pools and output")
        if kv_dim != head_dim or heads % kv_heads or out.shape != q.shape or q.stride(2) != 1:
            raise ValueError(f"native decode: q {tuple(q.shape)} does not fit K/V {kv_dim}")
        if out.dtype != torch.float32 or q.device.type != "cpu" or k_cache.device.type != "cpu":
            raise ValueError("native decode runs on CPU fp32 tensors")
        scales = _check_scales(k_cache, k_scale, v_scale, "native decode")
        if rows.dtype != np.int64 or lens.dtype != np.int64 or tables.dtype != np.int32:
            raise ValueError("native decode: rows/lens int64, tables int32")
        if tables.ndim != 2 or len(tables) != n or len(lens) != n or not tables.flags.c_contiguous:
            raise ValueError("native decode: tables [n, W] C-contiguous, one row per sequence")
        if n == 0:
            return
        failed = self._fn(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            *scales, kind, rows.ctypes.data, tables.ctypes.data, tables.shape[1],
            lens.ctypes.data, n, block_size, heads, kv_heads, head_dim, scale,
            sliding_window or 0, softcap or 0.0, out.data_ptr(), num_threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("native decode: could not allocate its scratch scores")


def _check_scales(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, what: str
) -> tuple[int | None, int | None]:
    """The scale pools' addresses for ``cache``'s dtype: (None, None) for float32 and bfloat16;
    for an 8-bit pool both must be contiguous fp32 CPU ``[num_blocks, block_size, kv_heads]``."""
    if cache.dtype in UNSCALED_KV:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{what}: scales belong to 8-bit pools, not {cache.dtype} ones")
        return None, None
    if k_scale is None or v_scale is None:
        raise ValueError(f"{what}: an 8-bit {cache.dtype} pool needs its k_scale and v_scale")
    for t in (k_scale, v_scale):
        if t.shape != cache.shape[:3] or t.dtype != torch.float32:
            raise ValueError(
                f"{what}: scales must be float32 {tuple(cache.shape[:3])}, got {t.dtype} "
                f"{tuple(t.shape)}"
            )
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{what}: scales must be contiguous CPU tensors")
    return k_scale.data_ptr(), v_scale.data_ptr()


class KvQuantize:
    """The loaded ``quire_kv_quantize`` symbol (``csrc/kv_quant.c``): ``kernels/kv_quant``'s
    write rule in C, which the native decode step uses to write its new K/V. Exposed to check
    it against ``kv_quant.quantize`` byte for byte."""

    def __init__(self, lib: Library) -> None:
        fn = lib.cdll.quire_kv_quantize
        fn.restype = None
        fn.argtypes = [_P, _I, _I, _I, ctypes.c_float, _P, _P]
        self._fn = fn

    def __call__(
        self, x: torch.Tensor, dtype: torch.dtype, fixed: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[..., D]`` fp32 -> (``dtype`` data of its shape, float32 scales ``[...]``),
        as ``kv_quant.quantize``; ``fixed``: one positive finite scale for every row."""
        kind = KV_KINDS.get(dtype)
        if kind is None or dtype == torch.float32:
            raise ValueError(f"not an 8-bit KV dtype: {dtype}")
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1:
            raise ValueError("native quantize takes a CPU fp32 tensor [..., D]")
        if fixed is not None and not 0.0 < fixed < float("inf"):
            raise ValueError(f"a fixed KV scale must be positive and finite, got {fixed!r}")
        x = x.contiguous()
        data = torch.empty(x.shape, dtype=dtype)
        scales = torch.empty(x.shape[:-1], dtype=torch.float32)
        rows, d = scales.numel(), x.shape[-1]
        if rows and d:
            self._fn(x.data_ptr(), rows, d, kind, fixed or 0.0, data.data_ptr(), scales.data_ptr())
        return data, scales


class SkinnyLinear:
    """The loaded ``quire_skinny_linear`` symbol with its checked Python signature."""

    def __init__(self, lib: Library) -> None:
        self.path = lib.path
        fn = lib.cdll.quire_skinny_linear
        fn.restype = None
        fn.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P, _I, _I]
        self._fn = fn

    def __call__(
        self,
        x: torch.Tensor,  # [M, K] fp32, K contiguous
        weight: torch.Tensor,  # [N, K] fp32, contiguous
        bias: torch.Tensor | None,  # [N] fp32, contiguous
        out: torch.Tensor,  # [M, N] fp32, N contiguous
        num_threads: int = 1,
    ) -> None:
        """``out = x @ weight.T + bias``, every element summed in an order that depends only on
        K (the same bits for a row whatever the other rows)."""
        if x.dim() != 2 or weight.dim() != 2 or out.dim() != 2:
            raise ValueError("native linear: x [M, K], weight [N, K] and out [M, N]")
        (m, k), (n, k_w) = x.shape, weight.shape
        if k_w != k or tuple(out.shape) != (m, n):
            raise ValueError(
                f"native linear: x {tuple(x.shape)} @ weight {tuple(weight.shape)}.T does not "
                f"fit out {tuple(out.shape)}"
            )
        tensors = [x, weight, out] if bias is None else [x, weight, out, bias]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            raise ValueError("native linear runs on CPU fp32 tensors")
        if not weight.is_contiguous() or x.stride(1) != 1 or out.stride(1) != 1:
            raise ValueError("native linear needs a contiguous weight and K/N-contiguous rows")
        if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"native linear: bias must be [{n}] and contiguous")
        if m == 0 or n == 0:
            return
        self._fn(
            x.data_ptr(), x.stride(0), m, weight.data_ptr(),
            None if bias is None else bias.data_ptr(), n, k, out.data_ptr(), out.stride(0),
            num_threads,
        )  # fmt: skip

    def launch(
        self,
        x: torch.Tensor,  # [..., K] contiguous: `rows` rows of K
        rows: int,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,  # [..., N] contiguous
        num_threads: int,
    ) -> None:
        """``__call__`` for contiguous rows in any leading shape, without its checks, for a
        caller that guarantees them (``linear_cpu``, on every matmul of a decode step: the
        checks and the [rows, K] views cost several times the C call's own overhead there)."""
        n, k = weight.shape
        self._fn(
            x.data_ptr(), k, rows, weight.data_ptr(), None if bias is None else bias.data_ptr(),
            n, k, out.data_ptr(), n, num_threads,
        )  # fmt: skip


@functools.cache
def paged_decode() -> PagedDecode | None:
    """The native decode kernel, or None when the native kernels are off or cannot be built."""
    lib = library()
    return None if lib is None else PagedDecode(lib)


@functools.cache
def skinny_linear() -> SkinnyLinear | None:
    """The native few-row linear, or None when the native kernels are off or cannot be built."""
    lib = library()
    return None if lib is None else SkinnyLinear(lib)


@functools.cache
def kv_quantize() -> KvQuantize | None:
    """The native KV quantizer, or None when the native kernels are off or cannot be built."""
    lib = library()
    return None if lib is None else KvQuantize(lib)


@functools.cache
def decoder_decode() -> DecoderDecode | None:
    """The native decode step, or None when the native kernels are off or cannot be built."""
    lib = library()
    return None if lib is None else DecoderDecode(lib)


def reset() -> None:
    """Forget the loaded library and kernels, so that the next call builds or loads them again
    under the current environment (tests; a process that changed ``QUIRE_*`` or ``CC``)."""
    for cached in (library, paged_decode, skinny_linear, kv_quantize, decoder_decode):
        cached.cache_clear()


def _identity(cc: str) -> list[bytes]:
    """What the cache key covers besides the flags: sources, headers, compiler, CPU."""
    identity = [*(src.read_bytes() for src in SOURCES + HEADERS), _version(cc).encode()]
    identity.append(_cpu_identity().encode())
    identity.append(platform.machine().encode())
    return identity


def _load(cc: str, identity: list[bytes], flags: tuple[str, ...], directory: Path) -> Library | str:
    """The library built with ``flags`` in ``directory`` (built there first unless cached), or
    what went wrong."""
    flag_text = " ".join(_BASE_FLAGS + flags).encode()
    key = hashlib.sha256(b"\0".join([*identity, flag_text])).hexdigest()[:20]
    target = directory / f"quire_native-{key}.so"
    if not target.exists():
        problem = _build(cc, flags, target)
        if problem is not None:
            return f"{' '.join(flags) or '(no flags)'}: {problem}"
    try:
        return Library(ctypes.CDLL(str(target)), target, flags)
    except OSError as exc:
        return f"{target}: {exc}"


def build(flags: tuple[str, ...], directory: Path) -> Library:
    """The library compiled with exactly ``flags`` after the base flags, cached in ``directory``
    like ``library``'s; ``RuntimeError`` with the compiler's message when there is no compiler or
    the build fails. For checks of the sources (a build with warnings as errors, one with
    AddressSanitizer); the engine's kernels come from ``library``."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    directory.mkdir(parents=True, exist_ok=True)
    found = _load(cc, _identity(cc), flags, directory)
    if isinstance(found, str):
        raise RuntimeError(f"the native kernels did not build with {cc}: {found}")
    return found


@functools.cache
def library() -> Library | None:
    """The native kernels' library, built or loaded once per process; None when it is turned
    off, or no compiler can build it (logged once)."""
    if not enabled():
        logger.info("native CPU kernels off (QUIRE_NATIVE_KERNELS); the torch paths run")
        return None
    cc = compiler()
    if cc is None:
        logger.warning(
            "no C compiler (set CC, or install gcc): CPU decode attention and small-batch "
            "matmuls use the slower torch paths"
        )
        return None
    identity = _identity(cc)
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{directory} is not writable")
    except OSError as exc:  # e.g. a read-only home: build for this process only
        directory = Path(tempfile.mkdtemp(prefix="quire-kernels-"))
        logger.info("kernel cache unusable (%s); building into %s", exc, directory)
    errors: list[str] = []
    for flags in FLAG_SETS:
        found = _load(cc, identity, flags, directory)
        if isinstance(found, str):
            errors.append(found)
            continue
        logger.info("native CPU kernels: %s (%s)", found.path, " ".join(flags))
        return found
    logger.warning(
        "could not build the native CPU kernels with %s; decode attention and small-batch "
        "matmuls use the slower torch paths:\n%s",
        cc,
        "\n".join(errors),
    )
    return None
