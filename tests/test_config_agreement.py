"""The operator and its CRD agree with the engine's configuration: every ``spec.engine`` field
that is an engine knob has the knob's type, default and bounds (in ``crds/`` and the chart's
copy), the operator's own bound constants are the engine's, and every flag the operator manages
is one ``quire-engine serve`` has. The operator never imports the engine; this test reads both.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from quire_engine.core import knobs
from quire_engine.server.cli import ServeOptions, add_arguments
from quire_operator.builders import deployment
from quire_operator.spec import view as spec

ROOT = Path(__file__).resolve().parent.parent
CRDS = [
    ROOT / "crds" / "inferenceservices.quire.dev.yaml",
    ROOT / "charts" / "quire" / "crds" / "inferenceservices.quire.dev.yaml",
]
# spec.engine fields that are the operator's own, not engine knobs.
OPERATOR_ONLY = {"image", "imagePullPolicy", "preStopDelaySeconds", "extraArgs"}
# Where the operator is stricter than the engine, and why (bounds the engine does not have).
NARROWER = {
    # The drain must fit the pod's terminationGracePeriodSeconds, which the operator sizes in
    # whole seconds.
    ("shutdownTimeoutSeconds", "maximum"): 3600,
    ("shutdownTimeoutSeconds", "type"): "integer",
}
_TYPES = {
    knobs.Kind.INT: "integer",
    knobs.Kind.FLOAT: "number",
    knobs.Kind.BOOL: "boolean",
    knobs.Kind.STR: "string",
    knobs.Kind.ENUM: "string",
}
_UNITS = {"GiB": "GiB", "seconds": "Seconds"}


def crd_field(entry: knobs.Entry) -> str:
    """The naming rule the CRD follows: camelCase of the knob plus its unit."""
    first, *rest = entry.name.split("_")
    return first + "".join(p.capitalize() for p in rest) + _UNITS.get(entry.knob.unit, "")


def engine_properties(path: Path) -> dict[str, Any]:
    (version,) = yaml.safe_load(path.read_text())["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    properties: dict[str, Any] = schema["engine"]["properties"]
    return properties


def knob_fields() -> dict[str, knobs.Entry]:
    return {crd_field(e): e for e in knobs.walk(ServeOptions) if e.knob.flag}


@pytest.mark.parametrize("crd", CRDS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_crds_engine_fields_are_the_engines_knobs(crd: Path) -> None:
    by_field = knob_fields()
    properties = engine_properties(crd)
    unknown = set(properties) - set(by_field) - OPERATOR_ONLY
    assert not unknown, f"spec.engine fields that are no engine knob: {sorted(unknown)}"
    for name, node in properties.items():
        if name in OPERATOR_ONLY:
            continue
        entry, k = by_field[name], by_field[name].knob
        where = f"{crd.name}: spec.engine.{name} vs {entry.flag}"
        assert node["type"] == NARROWER.get((name, "type"), _TYPES[entry.kind]), where
        assert node.get("default") == entry.flag_default, where
        assert node.get("enum") == (list(entry.choices) if entry.choices else None), where
        low = k.above if k.above is not None else k.min
        if k.power_of_two:
            (rule,) = node["x-kubernetes-validations"]
            top = int(k.max or 0)
            sizes = [2**i for i in range(top.bit_length()) if (k.min or 1) <= 2**i <= top]
            assert rule["rule"] == f"self in [{', '.join(map(str, sizes))}]", where
            assert "minimum" not in node and "maximum" not in node, where
            continue
        assert node.get("minimum") == low, where
        assert bool(node.get("exclusiveMinimum")) == (k.above is not None), where
        assert node.get("maximum") == NARROWER.get((name, "maximum"), k.max), where


def test_the_operators_bounds_are_the_engines() -> None:
    by_name = {e.name: e for e in knobs.walk(ServeOptions)}
    block, utilization = by_name["block_size"].knob, by_name["gpu_memory_utilization"].knob
    assert tuple(2**i for i in range(int(block.max or 0).bit_length())) == spec.BLOCK_SIZES
    assert utilization.max == spec.MAX_GPU_MEMORY_UTILIZATION
    shutdown = spec.EngineSpec.__dataclass_fields__["shutdown_timeout_s"].default
    assert shutdown == by_name["shutdown_timeout"].flag_default


def test_every_managed_flag_is_a_serve_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    serve_flags = {s for action in parser._actions for s in action.option_strings}
    missing = [flag for flag in deployment.MANAGED_FLAGS if flag not in serve_flags]
    assert not missing, f"MANAGED_FLAGS that quire-engine serve does not have: {missing}"
    # Every spec.engine knob field reaches the engine as a flag the operator manages.
    managed = set(deployment.MANAGED_FLAGS)
    by_field = knob_fields()
    for name in set(engine_properties(CRDS[0])) - OPERATOR_ONLY:
        assert by_field[name].flag in managed, name
