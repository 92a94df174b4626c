"""The model cache's download and the engine's wait for it (``quire_engine.hub_cache``), against
a Hub stand-in on loopback serving a tiny saved checkpoint (tests/hub_server.py), reached through
``HF_ENDPOINT`` as a mirror would be: real huggingface_hub code end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from quire_engine.hub_cache import (
    MARKER,
    CacheError,
    cache_dir,
    download,
    read_marker,
    wait_for_cache,
)
from tests.engine_tests import models
from tests.engine_tests.live_server import ENGINE_DIR, engine_process
from tests.hub_server import HubServer
from tests.waiting import wait_until

REPO = "quire-test/tiny-llama"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build("llama", tmp_path_factory.mktemp("hub") / "tiny-llama")


@pytest.fixture
def hub(checkpoint: Path) -> Iterator[HubServer]:
    server = HubServer(REPO, checkpoint).start()
    yield server
    server.stop()


def _same_files(model_dir: Path, checkpoint: Path) -> None:
    for source in checkpoint.rglob("*"):
        if source.is_file():
            copy = model_dir / source.relative_to(checkpoint)
            assert copy.read_bytes() == source.read_bytes(), copy


def run_job(hub: HubServer, tmp_path: Path, model_dir: Path, revision: str) -> tuple[int, str]:
    """``python -m quire_engine.hub_cache download`` as the Job runs it, with the Hub stand-in
    as its mirror: (exit code, termination message)."""
    message = tmp_path / "termination-log"
    argv = [
        sys.executable, "-m", "quire_engine.hub_cache", "download", "--repo", REPO,
        "--revision", revision, "--dir", str(model_dir),
        "--termination-message-path", str(message),
    ]  # fmt: skip
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    env["PYTHONPATH"] = os.pathsep.join([str(ENGINE_DIR), env.get("PYTHONPATH", "")])
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, message.read_text()


def test_the_job_downloads_verifies_and_marks_the_directory_complete(
    hub: HubServer, checkpoint: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "cache" / "model"
    code, message = run_job(hub, tmp_path, model_dir, "main")
    assert code == 0, message

    summary = json.loads(message)
    assert summary == {"commit": hub.commit, "bytes": hub.total_bytes, "files": len(hub.files)}
    completion = read_marker(model_dir)
    assert completion is not None
    assert (completion.repo, completion.revision, completion.commit) == (REPO, "main", hub.commit)
    assert {f.path: f.size for f in completion.files} == {
        path: len(f.data) for path, f in hub.files.items()
    }
    assert {f.path: f.sha256 for f in completion.files if f.sha256} == {
        WEIGHTS: hub.files[WEIGHTS].sha256
    }
    _same_files(model_dir, checkpoint)
    # Each file's body was sent exactly once.
    assert dict(hub.body_bytes) == {path: len(f.data) for path, f in hub.files.items()}

    # Run again on the complete directory: nothing is asked of the Hub.
    before = sum(hub.requests.values())
    assert download(REPO, model_dir, revision="main", endpoint=hub.url) == completion
    assert sum(hub.requests.values()) == before


def test_a_corrupt_file_fails_the_download_and_only_it_is_fetched_again(
    hub: HubServer, checkpoint: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    good = hub.files[WEIGHTS].data
    hub.corrupt[WEIGHTS] = bytes([good[0] ^ 0xFF]) + good[1:]  # same size, other sha256
    with pytest.raises(CacheError, match=f"{WEIGHTS}: sha256 {hub.files[WEIGHTS].sha256}"):
        download(REPO, model_dir, endpoint=hub.url)
    assert not (model_dir / MARKER).exists()
    assert not (model_dir / WEIGHTS).exists()  # deleted, so the retry fetches it again
    assert (model_dir / "config.json").is_file()

    hub.corrupt.clear()
    sent = dict(hub.body_bytes)
    completion = download(REPO, model_dir, endpoint=hub.url)
    assert completion.commit == hub.commit and completion.bytes == hub.total_bytes
    # The retry resumed: only the deleted file crossed the wire again.
    again = {path: n - sent.get(path, 0) for path, n in hub.body_bytes.items()}
    assert {path: n for path, n in again.items() if n} == {WEIGHTS: len(good)}
    _same_files(model_dir, checkpoint)


def test_a_transfer_cut_midway_resumes_where_it_stopped(
    hub: HubServer, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    # huggingface_hub resumes from the last whole chunk it wrote (10 MB on the Hub); chunks
    # smaller than the tiny checkpoint make its resume visible here.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    size = len(hub.files[WEIGHTS].data)
    hub.cut.add(WEIGHTS)
    completion = download(REPO, tmp_path / "model", endpoint=hub.url)
    assert completion.bytes == hub.total_bytes
    # It asked for the rest with a Range request from where its last chunk ended: only the
    # tail of the cut response that never made a whole chunk was sent twice.
    ((path, start),) = hub.ranges
    assert path == WEIGHTS and 0 < start <= size // 2
    assert hub.body_bytes[WEIGHTS] == size + (size // 2 - start)
    _same_files(tmp_path / "model", checkpoint)


def test_an_unknown_revision_ends_the_job_with_exit_code_2_and_the_reason(
    hub: HubServer, tmp_path: Path
) -> None:
    code, message = run_job(hub, tmp_path, tmp_path / "model", "v9")
    assert code == 2  # the operator's Job fails at once on it: no retry can help
    assert message.startswith("RevisionNotFoundError: ")
    assert not (tmp_path / "model" / MARKER).exists()


def test_one_gguf_file_is_fetched_alone_and_marked_as_such(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """``--file``: a repository of several GGUF files (one per quantization) gives only the one
    asked for; the marker says so, so the whole repository or another file is fetched later,
    and a file the repository lacks ends the Job with exit code 2."""
    repo_dir = tmp_path_factory.mktemp("gguf-repo")
    for name in ("m-q4.gguf", "m-q8.gguf"):
        (repo_dir / name).write_bytes(name.encode() * 1000)
    (repo_dir / "README.md").write_text("two quantizations\n")
    hub = HubServer(REPO, repo_dir).start()
    try:
        model_dir = tmp_path / "model"
        completion = download(REPO, model_dir, endpoint=hub.url, only="m-q4.gguf")
        assert completion.only == "m-q4.gguf"
        assert [f.path for f in completion.files] == ["m-q4.gguf"]
        assert sorted(p.name for p in model_dir.iterdir() if not p.name.startswith(".")) == [
            "m-q4.gguf"
        ]
        assert (model_dir / "m-q4.gguf").read_bytes() == hub.files["m-q4.gguf"].data
        assert dict(hub.body_bytes) == {"m-q4.gguf": len(hub.files["m-q4.gguf"].data)}
        assert read_marker(model_dir) == completion
        before = sum(hub.requests.values())
        assert download(REPO, model_dir, endpoint=hub.url, only="m-q4.gguf") == completion
        assert sum(hub.requests.values()) == before  # complete: nothing asked
        # The engine waits for the directory of the file it serves.
        assert wait_for_cache(cache_dir(model_dir / "m-q4.gguf"), 0.0) == completion
        other = download(REPO, model_dir, endpoint=hub.url, only="m-q8.gguf")
        assert [f.path for f in other.files] == ["m-q8.gguf"]
        whole = download(REPO, model_dir, endpoint=hub.url)
        assert whole.only is None and len(whole.files) == 3
        # A whole repository answers for any one file of it.
        assert download(REPO, model_dir, endpoint=hub.url, only="m-q4.gguf") == whole
        message = tmp_path / "termination-log"
        argv = [
            sys.executable, "-m", "quire_engine.hub_cache", "download", "--repo", REPO,
            "--dir", str(tmp_path / "other"), "--file", "absent.gguf",
            "--termination-message-path", str(message),
        ]  # fmt: skip
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
        env["PYTHONPATH"] = os.pathsep.join([str(ENGINE_DIR), env.get("PYTHONPATH", "")])
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert message.read_text().startswith("FileNotInRepo: ")
    finally:
        hub.stop()


def test_the_wait_returns_once_the_marker_is_there_and_fails_clearly_at_its_deadline(
    hub: HubServer, tmp_path: Path
) -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(CacheError, match=r"did not appear within 5 s"):
        wait_for_cache(tmp_path / "model", 5, clock=lambda: now[0], sleep=sleep)
    assert now[0] == 5

    completion = download(REPO, tmp_path / "model", endpoint=hub.url)
    assert wait_for_cache(tmp_path / "model", 5) == completion


@pytest.mark.slow
def test_the_engine_serves_only_once_the_cache_is_complete(hub: HubServer, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    flags = ("--model", str(model_dir), "--served-model-name", "cached", "--wait-for-model-cache")
    with engine_process(tmp_path, *flags, "--model-cache-timeout", "300") as engine:

        def status() -> int:
            assert engine.process.poll() is None, engine.log()
            return httpx2.get(f"{engine.url}/ready").status_code

        # Up (health answers) but not ready while the directory has no marker.
        assert wait_until(status, timeout=60, interval=0.2, message="/ready answers",
                          ignore=(httpx2.TransportError,)) == 503  # fmt: skip
        assert httpx2.get(f"{engine.url}/health").status_code == 200
        download(REPO, model_dir, endpoint=hub.url)
        engine.wait_ready()
        client = openai.OpenAI(base_url=engine.base_url, api_key="unused")
        out = client.completions.create(model="cached", prompt="Hello", max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens > 0
        # The wait is a start-up phase of its own.
        assert 'phase="model_cache"' in httpx2.get(f"{engine.url}/metrics").text


@pytest.mark.slow
def test_the_engine_exits_with_the_reason_when_the_cache_never_completes(tmp_path: Path) -> None:
    flags = ("--model", str(tmp_path / "model"), "--wait-for-model-cache")
    with engine_process(tmp_path, *flags, "--model-cache-timeout", "1") as engine:
        assert engine.wait_exit() == 1
        assert "the model cache is not complete" in engine.log()
        assert f"{tmp_path / 'model' / MARKER} did not appear within 1 s" in engine.log()


def test_waiting_for_the_embedded_model_is_refused(tmp_path: Path) -> None:
    with engine_process(tmp_path, "--wait-for-model-cache") as engine:
        assert engine.wait_exit() == 2
        assert "--wait-for-model-cache needs a checkpoint directory" in engine.log()
