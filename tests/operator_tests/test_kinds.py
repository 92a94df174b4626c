"""The table of kinds (quire_operator/kinds.py) against what reads it and what it describes: the
chart's RBAC rules, the children client, the watches, the builders' objects, the typed view.

No cluster: the chart's rules are read from charts/quire/templates/_helpers.tpl as written (the
install test compares what the API server stores with the same rules).
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from kubernetes import client

from quire_operator.builders.desired import (
    download_job,
    engine_children,
    model_cache_children,
    routing,
)
from quire_operator.children import Children
from quire_operator.config import OperatorConfig
from quire_operator.handlers import CHANGED_WHEN, CHILDREN, OPTIONAL_CHILDREN
from quire_operator.kinds import OPTIONAL, OWNED, RESOURCES, Kind, Verb, Watch
from quire_operator.spec.parsing import parse, read
from quire_operator.spec.view import InferenceService, InvalidSpec
from tests.operator_tests.helpers import ROOT, inference_service, load_example
from tests.operator_tests.rbac import NAMESPACED_RULES

HELPERS = ROOT / "charts" / "quire" / "templates" / "_helpers.tpl"
CONFIG = OperatorConfig(prometheus_address="http://prometheus.monitoring:9090")


def chart_rules() -> list[dict[str, Any]]:
    """The ``quire.rbac.rules`` block of the chart's helpers as the default values render it:
    plain YAML but for the ``{{- if ...}}``/``{{- end }}`` lines around rules a value turns off
    (all on by default, so dropping those lines keeps every rule)."""
    text = HELPERS.read_text()
    start = text.index('{{- define "quire.rbac.rules" -}}')
    body = text[start:].split("\n", 1)[1]
    block = body[: body.index("{{- end -}}")].splitlines()
    values = yaml.safe_load((HELPERS.parents[1] / "values.yaml").read_text())
    for switch in re.findall(r"\{\{- if \.Values\.([\w.]+) \}\}", "\n".join(block)):
        value: Any = values
        for key in switch.split("."):
            value = value[key]
        assert value is True, f"{switch} must default to true to render every rule"
    kept = "\n".join(line for line in block if not line.lstrip().startswith("{{"))
    rules: list[dict[str, Any]] = yaml.safe_load(kept)
    return rules


def everything() -> InferenceService:
    """The example with every child kind: routing, KEDA, a model cache, two replicas."""
    spec = load_example()["spec"]
    autoscaling = {**spec["autoscaling"], "backend": "keda"}
    model = {"uri": "hf://Qwen/Qwen2.5-0.5B", "cache": {"size": "20Gi"}}
    body = {
        **spec,
        "model": model,
        "autoscaling": autoscaling,
        "routing": {"mode": "InferencePool"},
    }
    return parse(inference_service(body, name="tiny"))


def test_the_charts_rules_are_the_tables() -> None:
    assert chart_rules() == NAMESPACED_RULES


def test_the_children_client_calls_every_owned_kind_and_no_other() -> None:
    assert Children(client.ApiClient()).kinds == frozenset(OWNED)
    assert set(OPTIONAL) == {Kind.SCALED_OBJECT, Kind.INFERENCE_POOL, Kind.LEADER_WORKER_SET}


def test_every_watched_kind_has_a_watch_and_its_verbs() -> None:
    watched = {kind for kind in Kind if RESOURCES[kind].watch is not Watch.NOT_WATCHED}
    assert set(CHILDREN) | set(OPTIONAL_CHILDREN) == watched
    assert set(OPTIONAL_CHILDREN) == {Kind.SCALED_OBJECT, Kind.INFERENCE_POOL}
    assert set(CHANGED_WHEN) == set(Watch) - {Watch.NOT_WATCHED}
    for kind in watched:
        assert {Verb.LIST, Verb.WATCH} <= set(RESOURCES[kind].verbs), kind
    for kind in OWNED:
        assert {Verb.GET, Verb.CREATE, Verb.PATCH} <= set(RESOURCES[kind].verbs), kind


def test_the_builders_objects_are_of_the_kinds_in_the_table() -> None:
    isvc = everything()
    cache = model_cache_children(isvc, CONFIG)
    wanted = {**cache, **engine_children(isvc, CONFIG), **routing(isvc, CONFIG)}
    built = {key: obj for key, obj in wanted.items() if obj is not None}
    assert {key.kind for key in wanted} == set(OWNED)
    for key, obj in built.items():
        assert (obj["apiVersion"], obj["kind"]) == (key.kind.api_version, key.kind.value)
        assert obj["metadata"]["name"] == key.name
    assert download_job(cache) == next(key.name for key in built if key.kind is Kind.JOB)


def test_an_invalid_spec_keeps_its_identity() -> None:
    body = inference_service(load_example()["spec"], name="tiny", generation=4)
    body["spec"]["routing"] = {"mode": "InferencePool"}
    body["spec"]["apiKeySecretRef"] = {"name": "key", "key": "k"}
    valid = read(body)
    assert isinstance(valid, InferenceService)
    body["spec"]["engine"]["blockSize"] = 7
    invalid = read(body)
    assert isinstance(invalid, InvalidSpec)
    assert "engine.blockSize" in invalid.error
    # The same facts as the parsed view's, read without it.
    assert invalid.identity == valid.identity
    assert (invalid.identity.generation, invalid.identity.routed) == (4, True)
    assert invalid.identity.api_key
