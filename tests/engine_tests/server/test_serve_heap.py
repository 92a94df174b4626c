"""The serving process freezes its startup heap once the model is loaded (so that full garbage
collections do not traverse torch, transformers and the model while streams wait), and exports
every collector pause as ``quire_gc_pause_seconds{generation}``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_tests.live_server import engine_process

# Each test loads the model in a child process: ~13 s and ~25 s here.
pytestmark = pytest.mark.slow

FREEZE = """
import gc, json
from quire_engine.engine.llm import LLM
llm = LLM(device="cpu", dtype="float32")
gc.collect()
alive = len(gc.get_objects())
from quire_engine.server.cli import freeze_startup_heap
frozen = freeze_startup_heap()
print(json.dumps({"alive": alive, "frozen": frozen, "left": len(gc.get_objects())}))
"""


def test_freeze_moves_the_loaded_heap_out_of_the_collectors_reach() -> None:
    # In a child process: freezing is process-wide, and this test process is not ours to freeze.
    done = subprocess.run(
        [sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=300, check=True
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["alive"] > 10_000 and counts["frozen"] >= 0.9 * counts["alive"]
    assert counts["left"] < counts["alive"] // 100  # what full collections still traverse


def test_the_server_freezes_after_loading_and_exports_gc_pauses(tmp_path: Path) -> None:
    with engine_process(tmp_path) as proc:
        proc.wait_ready()
        frozen = re.search(r"froze (\d+) objects of the startup heap", proc.log())
        assert frozen is not None, proc.log()
        assert int(frozen.group(1)) > 10_000
        text = httpx2.get(f"{proc.url}/metrics").text
    counts = {
        s.labels["generation"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "quire_gc_pause_seconds"
        for s in family.samples
        if s.name == "quire_gc_pause_seconds_count"
    }
    assert set(counts) == {"0", "1", "2"}
    assert counts["2"] >= 1  # the freeze's own full collection, after the metric was installed
