"""Tensor parallelism over several nodes, on loopback: node 0 is the engine (rank 0: scheduler,
HTTP) and node 1 a real ``quire-engine serve --headless`` process running rank 1, which joins node
0's rendezvous at ``--master-addr``:``--master-port`` and takes its plans over TCP.

Token-exact against one rank; and failure either way is loud and bounded: a dead worker rank
fails every request, turns ``/health`` 503 and makes the leader exit 1 (and its node exit 1); a
dead leader makes the worker node exit 1. Nothing waits without a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.core.config import EngineConfig
from quire_engine.server.cli import settings_from_args
from tests.engine_tests.live_server import (
    EngineHolder,
    EngineProcess,
    RunningServer,
    engine_process,
    serve,
    tiny_settings,
)
from tests.engine_tests.parallel.test_tensor_parallel_faults import _children, kill_mid_stream
from tests.engine_tests.server.test_server_errors import error_of
from tests.engine_tests.server.test_server_faults import assert_everyone_answered, in_flight
from tests.ports import free_port
from tests.waiting import wait_until

PROMPTS = ["Hello", "The quick brown fox", "a"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL = {"device": "cpu", "num_blocks": 64, "max_model_len": 128}


@contextlib.contextmanager
def worker_node(tmp_path: Path, port: int) -> Iterator[EngineProcess]:
    """Node 1 of 2 (rank 1 of a TP=2 group) as its own ``serve --headless`` process."""
    flags = ["--headless", "--node-rank", "1", "--nnodes", "2", "--tensor-parallel-size", "2"]
    flags += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--num-blocks", "256"]
    with engine_process(tmp_path, *flags) as node:
        yield node


@contextlib.contextmanager
def two_nodes(tmp_path: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    """Node 0 as a real ``quire-engine serve`` process (ready) and node 1 (its worker node)."""
    port = free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    with (
        worker_node(tmp_path, port) as node,
        engine_process(tmp_path, *flags, "--num-blocks", "256") as leader,
    ):
        leader.wait_ready(timeout=180)
        yield leader, node


def _rank_of(node: EngineProcess) -> int:
    """The pid of the headless node's one rank process (once it is spawned)."""
    found = wait_until(
        lambda: _children(node.process.pid) or None,
        timeout=60,
        interval=0.05,
        message=lambda: f"node 1 never spawned its rank\n{node.log()}",
    )
    (pid,) = found
    return pid


def test_two_nodes_match_one_rank(tmp_path: Path) -> None:
    with LLM("tiny", **SMALL) as one:
        expected = [r.outputs[0].token_ids for r in one.generate(PROMPTS, GREEDY)]
    port = free_port()
    with worker_node(tmp_path, port) as node:
        two = LLM("tiny", **SMALL, tensor_parallel_size=2, nnodes=2, master_port=port)
        with two:
            got = [r.outputs[0].token_ids for r in two.generate(PROMPTS, GREEDY)]
            assert two.kv_cache_stats().used == 0
            group = two.engine.parallel
            assert group is not None and group.pids == []  # no local worker: rank 1 is remote
        # Node 0 stopped its ranks: the worker node ends cleanly.
        assert node.wait_exit(timeout=60) == 0, node.log()
    assert got == expected


def test_two_nodes_serve_token_exact_and_a_killed_worker_stops_both(tmp_path: Path) -> None:
    with LLM("tiny", device="cpu", num_blocks=256) as one:
        expected = one.generate(["Hello"], GREEDY)[0].outputs[0].text
    with two_nodes(tmp_path) as (leader, node):
        client = openai.OpenAI(base_url=leader.base_url, api_key="unused", max_retries=0)
        out = client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=12,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == expected
        kill_mid_stream(leader.base_url, _rank_of(node))
        assert leader.wait_exit(timeout=60) == 1, leader.log()
        assert node.wait_exit(timeout=60) == 1, node.log()
    assert "tensor-parallel rank 1" in leader.log()


def test_a_worker_node_exits_nonzero_when_the_leader_dies(tmp_path: Path) -> None:
    with two_nodes(tmp_path) as (leader, node):
        leader.process.kill()
        assert node.wait_exit(timeout=60) == 1, node.log()
    assert "node 0 closed the connection" in node.log()


@pytest.fixture(params=[None], ids=["no-watchdog"])
def sharded(
    request: pytest.FixtureRequest, tmp_path: Path, holder: EngineHolder, deaths: list[bool]
) -> Iterator[tuple[RunningServer, EngineProcess]]:
    """An in-process node 0 (TP=2 over 2 nodes) and its worker node (``param``: node 0's step
    timeout)."""
    port = free_port()
    engine = {"tensor_parallel_size": 2, "nnodes": 2, "master_port": port}
    settings = tiny_settings(
        engine=engine,
        engine_factory=holder,
        on_engine_death=lambda: deaths.append(True),
        step_timeout=request.param,
    )
    with worker_node(tmp_path, port) as node, serve(settings, wait_ready=False) as running:
        # Node 1 is a fresh interpreter (torch's import alone takes seconds on a busy machine).
        running.wait_until(
            lambda: httpx2.get(f"{running.url}/ready").status_code == 200, "ready", timeout=180
        )
        yield running, node


def test_a_worker_rank_killed_mid_step_answers_everyone_and_turns_health_503(
    sharded: tuple[RunningServer, EngineProcess], deaths: list[bool]
) -> None:
    server, node = sharded
    join = in_flight(f"{server.base_url}/completions")
    server.wait_until(lambda: server.metric("quire_num_requests_running") == 6, "all running")
    os.kill(_rank_of(node), signal.SIGKILL)
    assert_everyone_answered(join(), "engine_down")
    server.wait_until(lambda: bool(deaths), "death reported")
    assert error_of(httpx2.get(f"{server.url}/health"), 503)["type"] == "server_error"
    assert node.wait_exit(timeout=60) == 1, node.log()


def test_a_worker_rank_killed_while_idle_turns_health_503(
    sharded: tuple[RunningServer, EngineProcess], deaths: list[bool]
) -> None:
    server, node = sharded
    assert httpx2.get(f"{server.url}/health").status_code == 200
    os.kill(_rank_of(node), signal.SIGKILL)
    server.wait_until(lambda: bool(deaths), "death reported")
    assert error_of(httpx2.get(f"{server.url}/health"), 503)["type"] == "server_error"


@pytest.mark.parametrize("sharded", [2.0], ids=["step-timeout-2s"], indirect=True)
def test_a_hung_worker_rank_turns_health_503_and_answers_everyone(
    sharded: tuple[RunningServer, EngineProcess], holder: EngineHolder, deaths: list[bool]
) -> None:
    """A stopped rank on the other node leaves node 0 waiting in a collective: the step watchdog
    gives up."""
    server, node = sharded
    join = in_flight(f"{server.base_url}/completions")
    server.wait_until(lambda: server.metric("quire_num_requests_running") == 6, "all running")
    rank = _rank_of(node)
    os.kill(rank, signal.SIGSTOP)
    try:
        assert_everyone_answered(join(), "engine_hung")
        assert error_of(httpx2.get(f"{server.url}/health"), 503)["type"] == "server_error"
        assert deaths == [True]
    finally:
        os.kill(rank, signal.SIGKILL)  # node 0's collective fails; its thread frees every block
        kv = holder.engine.scheduler.kv
        server.wait_until(lambda: kv.stats().used == 0, "blocks freed")


def test_nodes_are_validated() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3, the ranks of all nodes\)"):
        EngineConfig.from_flat(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank must be in 0\.\.1; got 2"):
        EngineConfig.from_flat(tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match=r"master_port must be in 1\.\.65535; got 0"):
        EngineConfig.from_flat(master_port=0)
    with pytest.raises(ValueError, match="node_rank 1 serves no requests"):
        LLM("tiny", **SMALL, tensor_parallel_size=2, nnodes=2, node_rank=1)


@pytest.mark.parametrize(
    "flags",
    [["--headless"], ["--node-rank", "1", "--nnodes", "2", "--tensor-parallel-size", "2"]],
    ids=["headless-node-0", "node-1-not-headless"],
)
def test_headless_goes_with_a_node_rank_above_0(flags: list[str]) -> None:
    from quire_engine.cli import build_parser

    args = build_parser(["serve", *flags]).parse_args(["serve", *flags])
    with pytest.raises(ValueError, match="--headless goes with --node-rank >= 1"):
        settings_from_args(args)


def test_the_leader_listens_on_its_http_host() -> None:
    from quire_engine.cli import build_parser

    argv = ["serve", "--host", "127.0.0.9", "--master-addr", "elsewhere", "--nnodes", "2"]
    argv += ["--tensor-parallel-size", "2"]
    config = settings_from_args(build_parser(argv).parse_args(argv)).engine.parallel
    assert (config.master_addr, config.nnodes, config.node_rank) == ("127.0.0.9", 2, 0)
