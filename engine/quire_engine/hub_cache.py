"""A model repository of the Hugging Face Hub in a directory of a shared volume: downloaded once,
verified, marked complete; and the engine's wait for that mark.

Two programs use it. The operator's download Job (``python -m quire_engine.hub_cache download``)
fetches ``repo`` at ``revision`` with huggingface_hub into a directory of the model cache volume
(or, with ``--file``, only that file of it: one GGUF file of a repository holding one per
quantization; the marker records it as ``only``); engines mount the same volume read-only and,
with ``quire-engine serve --wait-for-model-cache``, load the model only once ``wait_for_cache``
has seen the directory complete (``cache_dir``: the directory of a ``--model`` that is one file
in it).

Ownership: the download Job is the only writer of the directory. It pins the revision to the
commit the Hub names for it before fetching anything, so a branch moving meanwhile cannot mix two
commits. ``snapshot_download`` resumes: files already fetched for that commit are kept (its
``.cache/huggingface`` metadata), an interrupted transfer continues with an HTTP Range request.
Every file is then checked against the Hub's metadata (``model_info(files_metadata=True)``): its
size, the sha256 of LFS files, the git blob id of the others. A file that fails is deleted, so a
retry fetches it again. Only then is the marker ``.quire-complete.json`` written, last and
atomically (a temporary file renamed in place): its presence means the directory is complete and
will not change. Readers never look at anything else.

The endpoint is huggingface_hub's: ``HF_ENDPOINT`` (a mirror) or the Hub; the token ``HF_TOKEN``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

MARKER = ".quire-complete.json"
# Exit codes of ``download``: 1 for a failure a retry may fix (the network, a corrupt transfer),
# 2 when the Hub refuses the repository or revision (not found, gated, no access), which no
# retry fixes (the operator's Job fails at once on it).
EXIT_FAILED, EXIT_REFUSED = 1, 2
# Kubernetes keeps at most 4096 bytes of a termination message.
MAX_TERMINATION_MESSAGE = 4096
_CHUNK = 1 << 20
GGUF_SUFFIX = ".gguf"  # model.gguf.SUFFIX, without importing transformers here


class CacheError(RuntimeError):
    """The model cache cannot be filled or is not complete (the message says why)."""


class FileNotInRepo(CacheError):
    """The one file asked for is not in the repository at that revision: no retry helps."""


@dataclass(frozen=True)
class CachedFile:
    """One file of the repository: its path in it, size, and sha256 (LFS files only)."""

    path: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class Completion:
    """What the marker records: the repository, the revision asked for (None: the default
    branch), the commit it resolved to, every file, and ``only``: the one file asked for (a
    GGUF file of a repository holding several), None when it is the whole repository."""

    repo: str
    revision: str | None
    commit: str
    files: tuple[CachedFile, ...]
    only: str | None = None

    def holds(self, repo: str, revision: str | None, only: str | None) -> bool:
        """Whether this directory already answers a download of ``repo`` at ``revision``
        (``only``: one file of it)."""
        same = (self.repo, self.revision) == (repo, revision)
        return same and (self.only is None or self.only == only)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "repo": self.repo,
            "revision": self.revision,
            "commit": self.commit,
            "bytes": self.bytes,
            **({"only": self.only} if self.only is not None else {}),
            "files": [
                {"path": f.path, "size": f.size, **({"sha256": f.sha256} if f.sha256 else {})}
                for f in self.files
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Completion:
        files = tuple(CachedFile(f["path"], int(f["size"]), f.get("sha256")) for f in data["files"])
        return cls(data["repo"], data.get("revision"), data["commit"], files, data.get("only"))

    def summary(self) -> str:
        """One JSON line for the Job's termination message (far under its 4096 bytes)."""
        return json.dumps(
            {"commit": self.commit, "bytes": self.bytes, "files": len(self.files)},
            separators=(",", ":"),
        )


def read_marker(model_dir: Path) -> Completion | None:
    """The directory's completion record, or None while it has none."""
    try:
        return Completion.from_json(json.loads((model_dir / MARKER).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise CacheError(f"{model_dir / MARKER} is not a completion record: {err}") from err


def cache_dir(model: Path) -> Path:
    """The cache directory ``--model`` is in: the directory itself, or, for one file of the
    repository (a GGUF file, ``deployment.model_path``), the directory holding it."""
    return model.parent if model.suffix == GGUF_SUFFIX else model


def wait_for_cache(
    model_dir: Path,
    timeout_s: float,
    *,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Completion:
    """Poll until ``model_dir`` holds its marker; raises ``CacheError`` after ``timeout_s``."""
    deadline = clock() + timeout_s
    while True:
        completion = read_marker(model_dir)
        if completion is not None:
            return completion
        if clock() >= deadline:
            raise CacheError(
                f"the model cache is not complete: {model_dir / MARKER} did not appear within "
                f"{timeout_s:g} s (the model cache's download Job has not finished; see the "
                "InferenceService's status.modelCache)"
            )
        sleep(poll_s)


def _hashes(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, read once."""
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # git's object id
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest()


def verify(model_dir: Path, siblings: Iterable[Any]) -> tuple[tuple[CachedFile, ...], list[str]]:
    """Check each file the Hub lists (``RepoSibling``: rfilename, size, blob_id, lfs) against
    the directory: (the files, one line per problem). A file with a problem is deleted, with the
    download metadata huggingface_hub keeps for it, so that a retry fetches it again."""
    files, problems = [], []
    metadata = model_dir / ".cache" / "huggingface" / "download"
    for sibling in siblings:
        name, lfs = sibling.rfilename, sibling.lfs
        size = int(lfs.size if lfs is not None else sibling.size)
        # LFS files are named by their sha256, the others by git's blob id.
        kind, expected = (
            ("sha256", lfs.sha256) if lfs is not None else ("git blob", sibling.blob_id)
        )
        files.append(CachedFile(name, size, lfs.sha256 if lfs is not None else None))
        path = model_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        sha256, blob = _hashes(path)
        actual = sha256 if lfs is not None else blob
        if path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, the Hub says {size}")
        elif actual != expected:
            problems.append(f"{name}: {kind} {expected} expected, got {actual}")
        else:
            continue
        path.unlink()
        (metadata / f"{name}.metadata").unlink(missing_ok=True)
    return tuple(files), problems


def _write_marker(model_dir: Path, completion: Completion) -> None:
    scratch = model_dir / f"{MARKER}.tmp"
    with scratch.open("w") as out:
        json.dump(completion.to_json(), out, indent=1)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())
    scratch.replace(model_dir / MARKER)
    directory = os.open(model_dir, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def download(
    repo: str,
    model_dir: Path,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    only: str | None = None,
) -> Completion:
    """Fill ``model_dir`` with ``repo`` at ``revision`` (``only``: just that file of it, a GGUF
    file) and mark it complete; a directory already marked for them is returned as it is,
    without a request. ``endpoint``/``token`` None: huggingface_hub's own (``HF_ENDPOINT``,
    ``HF_TOKEN``). Raises ``CacheError`` when a file does not match the Hub's metadata,
    ``FileNotInRepo`` when ``only`` is not a file of the repository."""
    done = read_marker(model_dir)
    if done is not None and done.holds(repo, revision, only):
        return done
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / MARKER).unlink(missing_ok=True)  # another repo or revision was here
    info = HfApi(endpoint=endpoint, token=token).model_info(
        repo, revision=revision, files_metadata=True
    )
    if info.sha is None or info.siblings is None:
        raise CacheError(f"the Hub's answer for {repo}@{revision} has no commit or file list")
    siblings = info.siblings
    if only is not None:
        siblings = [s for s in siblings if s.rfilename == only]
        if not siblings:
            raise FileNotInRepo(f"{repo}@{info.sha} has no file {only!r}")
    snapshot_download(
        repo,
        revision=info.sha,
        local_dir=model_dir,
        endpoint=endpoint,
        token=token,
        allow_patterns=None if only is None else [only],
    )
    files, problems = verify(model_dir, siblings)
    if problems:
        raise CacheError(
            f"{repo}@{info.sha}: {len(problems)} file(s) do not match the Hub's metadata and "
            f"were deleted: {'; '.join(problems)}"
        )
    completion = Completion(repo, revision, info.sha, files, only)
    _write_marker(model_dir, completion)
    return completion


# A LoRA adapter named by its Hub repository (``/v1/load_lora_adapter``, ``--lora-modules``).
HUB_SCHEME = "hf://"
_HUB_ADAPTER = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(@(?P<rev>[^\s@]+))?$"
)


def fetch_adapter(uri: str, root: Path) -> Path:
    """The local directory of the adapter ``hf://org/name[@revision]``: downloaded (verified,
    marked complete, as a model cache directory) into ``root/<org>/<name>/@<revision>`` unless
    it is there already. ``HF_ENDPOINT`` and ``HF_TOKEN`` are read now, not at import, so the
    endpoint a server was started with applies. ``ValueError`` for a uri of another shape."""
    match = _HUB_ADAPTER.match(uri)
    if match is None:
        raise ValueError(f"not hf://org/name or hf://org/name@revision: {uri!r}")
    repo, revision = match["repo"], match["rev"]
    directory = root / repo / f"@{quote(revision or 'main', safe='')}"
    download(
        repo,
        directory,
        revision=revision,
        endpoint=os.environ.get("HF_ENDPOINT") or None,
        token=os.environ.get("HF_TOKEN") or None,
    )
    return directory


def _write_termination_message(path: str | None, message: str) -> None:
    if path:
        Path(path).write_text(
            message.encode()[: MAX_TERMINATION_MESSAGE - 1].decode(errors="ignore")
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quire_engine.hub_cache")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("download", help="fill a model cache directory from the Hub")
    fetch.add_argument("--repo", required=True, help="org/name on the Hub")
    fetch.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    fetch.add_argument("--dir", required=True, type=Path, help="the model's directory")
    fetch.add_argument(
        "--file", default=None, help="fetch only this file of the repository (a GGUF file)"
    )
    fetch.add_argument(
        "--termination-message-path",
        default=None,
        help="where to write the outcome for Kubernetes (a JSON line, or the error)",
    )
    args = parser.parse_args(argv)
    try:
        completion = download(args.repo, args.dir, revision=args.revision, only=args.file)
    except Exception as err:  # every failure ends the Job's pod with its reason
        message = f"{type(err).__name__}: {err}"
        print(message, file=sys.stderr)
        _write_termination_message(args.termination_message_path, message)
        refused = (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, FileNotInRepo)
        return EXIT_REFUSED if isinstance(err, refused) else EXIT_FAILED
    summary = completion.summary()
    print(summary)
    _write_termination_message(args.termination_message_path, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
