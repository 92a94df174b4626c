"""Random LoRA adapters for the embedded ``tiny`` model, saved as peft adapter directories.

An adapter only has to fit the base model's shapes (the tiny Llama's config); its weights are
random, as in tests/engine_tests/model/test_lora.py, since what the e2e tests check is where its
requests go, not what it says. The directories are on the host, where the pod runner runs the
engines, so a ``file://`` adapter of ``spec.lora`` reaches them.

Ownership: ``make_tiny_adapters`` writes under the directory it is given (a pytest tmp path, which
pytest owns and removes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from quire_engine.model.tiny_model import build_tiny_model

# Attention projections only: small adapters, quick to save and to load.
TARGETS = ("q_proj", "v_proj")


def make_tiny_adapters(out: Path, names: Sequence[str], rank: int = 8) -> dict[str, Path]:
    """One random rank-``rank`` adapter of the tiny model per name, in ``out/<name>``."""
    import peft  # only the tests that make adapters need it

    paths: dict[str, Path] = {}
    for seed, name in enumerate(names, start=1):
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), init_lora_weights=False
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = peft.get_peft_model(build_tiny_model(), config)
        model.save_pretrained(str(out / name))
        paths[name] = out / name
    return paths
