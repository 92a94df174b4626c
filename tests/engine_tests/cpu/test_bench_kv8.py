"""``quire-engine bench kernel --device cpu --kv-cache-dtype``: the native decode kernel on a
float32 pool and on the same K/V in each 8-bit format, side by side (``bench/kernel.py``).

Its figures are timings and are not checked; what is: every format asked for is measured, its
bytes are the 8-bit pool's (a byte per element plus a 4-byte scale per token and KV head:
(D + 4) / 4D of float32's), and its output equals the torch reference on the same 8-bit pool to
rounding (1e-5, as the kernel's own tests) and float32's to the format's quantization error.
"""

from __future__ import annotations

import pytest

from quire_engine.bench import kernel as bench_kernel
from quire_engine.cli import build_parser
from tests.engine_tests.toolchain import require_native_kernels

ARGV = ["bench", "kernel", "--device", "cpu", "--dtype", "fp32", "--batch", "3", "--context"]
ARGV += ["70", "--num-heads", "8", "--num-kv-heads", "2", "--head-dim", "64", "--iters", "2"]


@pytest.mark.parametrize(
    ("choice", "formats"),
    [("all", ["fp32", "int8", "fp8_e4m3", "fp8_e5m2"]), ("fp8", ["fp32", "fp8_e4m3"])],
)
def test_side_by_side_of_the_formats(choice: str, formats: list[str]) -> None:
    require_native_kernels()
    argv = [*ARGV, "--warmup", "0", "--kv-cache-dtype", choice]
    result = bench_kernel.run(build_parser(argv).parse_args(argv))
    rows = result["kv_formats"]
    assert list(rows) == formats
    q_out = 2 * 3 * 8 * 64 * 4  # q read and the output written, float32
    rows_read = 2 * 3 * 70 * 2  # (token, KV head) rows of K and V
    assert rows["fp32"]["bytes_per_call"] == rows_read * 64 * 4 + q_out
    for name in formats[1:]:
        row = rows[name]
        assert row["bytes_per_call"] == rows_read * (64 + 4) + q_out
        assert row["max_abs_diff_vs_reference"] <= 1e-5
        assert 0 < row["max_abs_diff_vs_fp32"] < 0.2
        assert row["native_ms"] > 0 and row["us_per_token"] > 0


def test_8bit_formats_are_measured_on_cpu_only() -> None:
    argv = ["bench", "kernel", "--kv-cache-dtype", "int8"]
    with pytest.raises(ValueError, match="--device cpu"):
        bench_kernel.run(build_parser(argv).parse_args(argv))
