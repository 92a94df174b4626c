"""What a kubelet does before a pod's container: run its init containers in order, each to
completion, then the container itself (``python init_chain.py INIT_JSON -- ARGV``).

``INIT_JSON`` lists ``{"name", "argv", "env"}`` (the kubelet stand-in's plan of each init
container, paths already pointed at the pod's local volumes). A failing init container ends this
process with its exit code, so the runner counts it as the pod's container failing, as a kubelet
would hold the pod in ``Init:Error``; otherwise the container's program replaces this process
(same pid), so what the runner watches is the container.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python init_chain.py INIT_JSON -- ARGV...", file=sys.stderr)
        return 2
    for init in json.loads(Path(argv[0]).read_text()):
        print(f"init container {init['name']}: {' '.join(init['argv'])}", flush=True)
        code = subprocess.run(init["argv"], env={**os.environ, **init["env"]}).returncode
        if code:
            print(f"init container {init['name']} exited with {code}", flush=True)
            return code
    main_argv = argv[2:]
    os.execv(main_argv[0], main_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
