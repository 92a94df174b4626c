"""``cpu/bf16``: the CPU's native bf16 support is read from its flags and logged when a bf16
model starts on CPU; a CPU without it still serves, with a warning."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from quire_engine import LLM, SamplingParams
from quire_engine.cpu import bf16

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE = "flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n"
OLD = "flags\t\t: fpu sse2 avx2 fma\n"


@pytest.fixture
def cpuinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A fake /proc/cpuinfo the (cached) detection reads; the real answer is restored after."""
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(bf16, "_CPUINFO", path)
    bf16.support.cache_clear()
    yield path
    bf16.support.cache_clear()


def test_flags_are_read_from_cpuinfo() -> None:
    assert bf16.parse_flags(ZEN4) == ("avx512_bf16",)
    assert bf16.parse_flags(SAPPHIRE) == ("avx512_bf16", "amx_bf16")
    assert bf16.parse_flags(OLD) == ()
    assert bf16.parse_flags("") == ()


def test_native_support_is_logged(cpuinfo: Path, caplog: pytest.LogCaptureFixture) -> None:
    cpuinfo.write_text(SAPPHIRE)
    with caplog.at_level(logging.INFO, logger=bf16.__name__):
        found = bf16.log_support(torch.device("cpu"), torch.bfloat16)
    assert found == bf16.Bf16Support(("avx512_bf16", "amx_bf16"), bf16.Source.CPUINFO)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "native (avx512_bf16, amx_bf16" in caplog.text


def test_no_support_warns_and_nothing_else_logs(
    cpuinfo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cpuinfo.write_text(OLD)
    with caplog.at_level(logging.INFO, logger=bf16.__name__):
        assert bf16.log_support(torch.device("cpu"), torch.float32) is None
        found = bf16.log_support(torch.device("cpu"), torch.bfloat16)
    assert found is not None and not found.native
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "serving bf16 anyway" in caplog.text


def test_unreadable_cpuinfo_asks_onednn(cpuinfo: Path) -> None:
    """No flags to read (the file absent): oneDNN's answer, named as the source."""
    assert bf16.support().source in (bf16.Source.ONEDNN, bf16.Source.NONE)


def test_engine_without_bf16_serves_with_a_warning(
    cpuinfo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not refused: a bf16 engine on a CPU without the flags starts, warns, and generates."""
    cpuinfo.write_text(OLD)
    engine = {"device": "cpu", "dtype": "bfloat16", "num_blocks": 16, "max_model_len": 64}
    with caplog.at_level(logging.WARNING, logger=bf16.__name__), LLM(None, **engine) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))
        assert llm.engine.runner.k_caches[0].dtype == torch.bfloat16
    assert len(out[0].outputs[0].token_ids) == 3
    assert "serving bf16 anyway" in caplog.text
