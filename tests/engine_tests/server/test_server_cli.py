"""``quire-engine serve``: defaults, flags and their QUIRE_* variables, log format; and
``quire-engine bench serve`` run against a real ``quire-engine serve`` process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from quire_engine import cli
from quire_engine.bench.workload import sharegpt_like
from quire_engine.server.cli import JsonFormatter, env_name, parse_bytes, settings_from_args
from tests.engine_tests.live_server import ENGINE_DIR, EngineProcess
from tests.ports import free_port


@pytest.fixture(autouse=True)
def _no_quire_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("QUIRE_")]:
        monkeypatch.delenv(name)


def parse_serve(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_no_arguments_serve_the_tiny_model_on_loopback_8000() -> None:
    args = parse_serve()
    assert (args.host, args.port, args.model, args.device) == ("127.0.0.1", 8000, "tiny", "auto")
    settings = settings_from_args(args)
    assert settings.served_model_names == ("tiny",)
    assert settings.api_key is None and settings.max_waiting == 512  # finite by default
    assert settings.step_timeout == 60 and settings.shutdown_timeout == 30
    assert settings.engine.model.model == "tiny" and settings.engine.cache.enable_prefix_caching
    assert settings_from_args(parse_serve("--step-timeout", "0")).step_timeout is None


def test_environment_sets_every_flag_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {
        "QUIRE_PORT": "9001",
        "QUIRE_API_KEY": "k",
        "QUIRE_ENABLE_PREFIX_CACHING": "false",
        "QUIRE_SERVED_MODEL_NAME": "llama, llama-8b",
        "QUIRE_KV_CACHE_MEMORY": "2GiB",
        "QUIRE_PREEMPTION_MODE": "swap",
        "QUIRE_MAX_WAITING": "7",
        "QUIRE_SHUTDOWN_TIMEOUT": "45",
        "QUIRE_STEP_TIMEOUT": "120",
        "QUIRE_LOG_FORMAT": "json",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = parse_serve("--port", "9002", "--max-num-seqs", "8")
    assert args.port == 9002 and args.max_num_seqs == 8
    settings = settings_from_args(args)
    assert settings.api_key == "k" and settings.max_waiting == 7
    assert settings.shutdown_timeout == 45 and settings.step_timeout == 120
    assert settings.served_model_names == ("llama", "llama-8b")
    assert not settings.engine.cache.enable_prefix_caching
    assert settings.engine.cache.kv_cache_memory == 2 * 2**30
    assert settings.engine.scheduler.preemption_mode.value == "swap"
    assert args.log_format == "json"
    assert parse_serve("--enable-prefix-caching").enable_prefix_caching


def test_help_names_the_variable_of_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_serve("--help")
    text = " ".join(capsys.readouterr().out.split())
    flags = set(re.findall(r"--[a-z][a-z-]*", text)) - {"--help"}
    assert len(flags) > 20
    for flag in flags:
        # --no-X is X's negation; --node-rank is a flag of its own
        assert env_name(re.sub(r"^--no-", "--", flag)) in text, flag


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("QUIRE_PORT", "http"),
        ("QUIRE_PREEMPTION_MODE", "never"),
        ("QUIRE_ENABLE_PREFIX_CACHING", "maybe"),
    ],
)
def test_bad_variables_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        parse_serve()
    assert exited.value.code == 2
    assert name in capsys.readouterr().err


def test_values_the_engine_would_refuse_fail_before_serving() -> None:
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        settings_from_args(parse_serve("--max-waiting", "0"))
    with pytest.raises(ValueError, match="shutdown_timeout must be >= 0"):
        settings_from_args(parse_serve("--shutdown-timeout", "-1"))
    with pytest.raises(ValueError, match="step_timeout must be >= 0"):
        settings_from_args(parse_serve("--step-timeout", "-5"))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        settings_from_args(parse_serve("--block-size", "12"))
    assert cli.main(["serve", "--max-num-seqs", "0"]) == 2
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        settings_from_args(parse_serve("--enable-auto-tool-choice"))


def test_tool_and_reasoning_parsers() -> None:
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    settings = settings_from_args(parse_serve(*flags, "--reasoning-parser", "deepseek_r1"))
    assert settings.tools.enable_auto and settings.tools.parser == "llama3_json"
    assert settings.reasoning_parser == "deepseek_r1"
    plain = settings_from_args(parse_serve())
    assert plain.tools.parser is None and plain.reasoning_parser is None


def test_sizes() -> None:
    assert parse_bytes("1024") == 1024
    assert parse_bytes("2G") == 2 * 10**9
    assert parse_bytes("2GiB") == parse_bytes("2gi") == 2 * 2**30
    assert parse_bytes("1.5MiB") == 3 * 2**19
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_json_log_lines() -> None:
    record = logging.LogRecord("quire", logging.INFO, __file__, 1, "hello %s", ("x",), None)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello x" and line["level"] == "INFO" and line["logger"] == "quire"


@pytest.mark.slow
def test_bench_serve_against_quire_engine_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ENGINE_DIR),
        "QUIRE_PORT": str(port),  # every setting from the environment, as in a container
        "QUIRE_DEVICE": "cpu",
        "QUIRE_NUM_BLOCKS": "128",
        "QUIRE_MAX_MODEL_LEN": "256",
        "QUIRE_LOG_FORMAT": "json",
    }
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "quire_engine.cli", "serve"], env=env, stdout=log, stderr=log
        )
    child = EngineProcess(url, server, log_path)
    try:
        child.wait_ready()
        argv = ["bench", "serve", "--url", url, "--num-prompts", "6", "--request-rate", "20"]
        argv += ["--mean-prompt-len", "24", "--mean-output-len", "6", "--seed", "1", "--json"]
        assert cli.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        metrics = httpx2.get(f"{url}/metrics").text
    finally:
        server.send_signal(signal.SIGTERM)
    # SIGTERM drains (nothing was in flight) and exits 0.
    assert child.wait_exit() == 0, child.log()

    lengths = sharegpt_like(6, mean_prompt=24, mean_output=6, max_model_len=256, seed=1)
    assert report["completed"] == 6 and report["failed"] == 0, report["errors"]
    assert report["total_input_tokens"] == sum(length.prompt for length in lengths)
    assert report["total_output_tokens"] == sum(length.output for length in lengths)
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "p50", "p99"):
            value = report[f"{stat}_{metric}_ms"]
            assert value is None or value >= 0, (metric, stat)
        assert report[f"mean_{metric}_ms"] is not None or metric in ("tpot", "itl")
    assert 'quire_request_success_total{finished_reason="length",model_name="tiny"} 6.0' in metrics
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    finished = [line for line in lines if "finished: reason=length" in line["message"]]
    assert len(finished) == 6
    assert lines[-2]["message"] == "Application shutdown complete."


def test_abbreviated_flags_are_rejected() -> None:
    # The operator passes extraArgs after its own flags; `--block 32` must not silently
    # override --block-size by prefix matching.
    with pytest.raises(SystemExit):
        parse_serve("--block", "32")
    assert parse_serve("--block-size", "32").block_size == 32
