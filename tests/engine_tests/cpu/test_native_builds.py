"""The native kernels' sources (``cpu/csrc``) build without a single warning, and run without
a memory error under AddressSanitizer.

* Every flag set ``native.py`` may build with (``FLAG_SETS``: the vector units and OpenMP, then
  less) compiles with ``-Wall -Wextra -Werror`` on top: any warning fails. A flag set this
  compiler cannot build at all (no OpenMP, say) is not the sources' fault and is passed over;
  at least one must build.
* ``native_asan_driver.py`` runs every kernel (``paged_decode``, ``kv_quantize``,
  ``skinny_linear``, ``decoder_decode``; the first and last on float32 and each 8-bit KV
  format) on small, odd-sized inputs from a library built with
  ``-fsanitize=address``, in a child Python with the ASan runtime preloaded: it must exit 0
  with no ASan report.

Both need a C compiler (and the second its ASan runtime): skipped locally without one, a
failure in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quire_engine.cpu import native
from tests.engine_tests.toolchain import WARNING_FLAGS, asan_runtime, require_compiler

REPO = Path(__file__).resolve().parents[3]


def test_every_flag_set_compiles_without_warnings(tmp_path: Path) -> None:
    require_compiler()
    built = 0
    for flags in native.FLAG_SETS:
        try:
            native.build((*flags, *WARNING_FLAGS), tmp_path)
        except RuntimeError as strict:
            try:
                native.build(flags, tmp_path)
            except RuntimeError:
                continue  # this compiler cannot build this flag set at all
            pytest.fail(f"warnings with {' '.join(flags) or '(no flags)'}:\n{strict}")
        built += 1
    assert built, "no flag set builds at all"


def test_kernels_run_clean_under_address_sanitizer(tmp_path: Path) -> None:
    runtime = asan_runtime(require_compiler())
    env = {
        **os.environ,
        "LD_PRELOAD": str(runtime),
        # Leaks: Python and torch keep allocations until exit, which are not the kernels'.
        "ASAN_OPTIONS": "detect_leaks=0",
        "PYTHONPATH": os.pathsep.join([str(REPO / "engine"), str(REPO)]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine_tests.native_asan_driver", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = done.stdout + done.stderr
    assert "AddressSanitizer" not in output, output[-6000:]
    assert done.returncode == 0, output[-6000:]
    assert "ok: " in done.stdout
