"""An exported image run with runc, the way the chart's pods run it.

Ownership: a ``Bundle`` owns one image unpacked with umoci (its root filesystem and the runtime
config umoci derived from the image's config: entrypoint, user, environment, working dir). A
``Container`` owns one runc container made from a bundle (its own config.json in its own
directory, its log) and deletes it when stopped.

As the chart runs them: the image's own user (10001 from the Dockerfile's USER; nothing here
overrides it), a read-only root, no capabilities, no privilege escalation, and a writable
``/tmp`` where the chart mounts an emptyDir. Unlike a pod, the container shares the host's
network namespace: the test cluster's API server and the engine's clients are on its loopback
(kwok nodes run no containers, so there is no pod network to join).
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.process import ManagedProcess
from tests.images.build import BuiltImage
from tests.images.host import run_checked


@dataclass(frozen=True)
class Mount:
    source: Path
    destination: str
    writable: bool = False


@dataclass(frozen=True)
class Bundle:
    path: Path

    @classmethod
    def unpack(cls, image: BuiltImage, dest: Path) -> Bundle:
        """umoci's runtime bundle of the image in ``image``'s OCI layout (what users get)."""
        source = f"{image.oci_layout}:{image.version}"
        run_checked(["nice", "-n", "19", "umoci", "unpack", "--image", source, str(dest)], "umoci")
        return cls(dest)

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs"

    def config(self) -> dict[str, Any]:
        """The runtime config umoci made from the image's config."""
        loaded: dict[str, Any] = json.loads((self.path / "config.json").read_text())
        return loaded


class Container:
    """One runc container of ``bundle``: the image's entrypoint plus ``args``, the image's
    environment updated with ``env``, and ``mounts`` (bind mounts) on top of the chart's."""

    def __init__(
        self,
        bundle: Bundle,
        workdir: Path,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        mounts: Sequence[Mount] = (),
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.id = f"quire-{uuid.uuid4().hex[:10]}"
        self.log_path = workdir / "container.log"
        config = _hardened(bundle, args, env or {}, mounts)
        (workdir / "config.json").write_text(json.dumps(config, indent=1))
        argv = ["runc", "run", "--bundle", str(workdir), self.id]
        self.process = ManagedProcess(self.id, argv, self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        return self.process.describe_failure(lines=80)

    def uids(self) -> tuple[int, ...]:
        """The real, effective, saved and filesystem uids of the container's first process."""
        state = json.loads(run_checked(["runc", "state", self.id], "runc state"))
        status = Path(f"/proc/{state['pid']}/status").read_text()
        match = re.search(r"^Uid:\s+(.*)$", status, re.M)
        assert match is not None, status
        return tuple(int(uid) for uid in match.group(1).split())

    def stop(self) -> None:
        """SIGTERM (runc forwards it to the entrypoint), SIGKILL after 15 s, then delete."""
        try:
            self.process.stop(grace_s=15)
        finally:
            subprocess.run(["runc", "delete", "--force", self.id], capture_output=True, check=False)


def _hardened(
    bundle: Bundle, args: Sequence[str], env: Mapping[str, str], mounts: Sequence[Mount]
) -> dict[str, Any]:
    """umoci's config with the chart's securityContext applied and the test's changes."""
    config = bundle.config()
    config["root"] = {"path": str(bundle.rootfs), "readonly": True}  # readOnlyRootFilesystem
    process = config["process"]
    process["terminal"] = False
    process["args"] = [*process["args"], *args]
    merged = dict(entry.split("=", 1) for entry in process.get("env", []))
    process["env"] = [f"{key}={value}" for key, value in {**merged, **env}.items()]
    process["noNewPrivileges"] = True  # allowPrivilegeEscalation: false
    process["capabilities"] = {}  # capabilities: drop [ALL]
    linux = config["linux"]
    linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]
    config["mounts"] = [
        *config["mounts"],
        *(
            {
                "destination": mount.destination,
                "type": "bind",
                "source": str(mount.source),
                "options": ["rbind", "rw" if mount.writable else "ro"],
            }
            for mount in mounts
        ),
    ]
    return config
