"""lm-eval against the server: a loglikelihood task (multiple choice: ``echo`` with
``logprobs`` and ``max_tokens`` 1) and a generation task through ``local-completions``, and the
generation task through ``local-chat-completions``, on a small offline dataset written here.

lm-eval runs from a virtualenv of its own (``lm_eval_env``: it cannot share the project's), as
a subprocess against the live server. Without CI the test is skipped when that virtualenv
cannot be installed (no package index); under ``CI=true`` a failed install fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from quire_engine.model.tiny_model import build_tokenizer
from tests.cluster.build import BuildError
from tests.engine_tests.live_server import RunningServer
from tests.engine_tests.lm_eval_env import ensure_lm_eval

TASKS = {
    "quire_mc": "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
    "quire_gen": "output_type: generate_until\ndoc_to_target: '{{choices[answer]}}'\n"
    "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n"
    "metric_list:\n  - metric: exact_match\n",
}
# Run by the virtualenv's python: argv = base URL, tokenizer directory, tasks directory; prints
# {"completions": results, "chat": results}.
DRIVER = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

base, tokenizer, tasks = sys.argv[1:4]
manager = TaskManager(include_path=tasks)
completions = simple_evaluate(
    model="local-completions",
    model_args=f"model=tiny,base_url={base}/completions,tokenizer={tokenizer},"
    "tokenizer_backend=huggingface,max_retries=1",
    tasks=["quire_mc", "quire_gen"],
    task_manager=manager,
)
chat = simple_evaluate(
    model="local-chat-completions",
    model_args=f"model=tiny,base_url={base}/chat/completions,max_retries=1",
    tasks=["quire_gen"],
    task_manager=manager,
    apply_chat_template=True,
)
print("RESULTS " + json.dumps({"completions": completions["results"], "chat": chat["results"]}))
"""


def _tasks(root: Path) -> Path:
    rows = [
        {"question": f"{i} + 2 =", "choices": [f" {i + 2}", f" {i + 3}", " x"], "answer": 0}
        for i in range(6)
    ]
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    for name, body in TASKS.items():
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\ndoc_to_text: '{{{{question}}}}'\n"
        )
        (root / f"{name}.yaml").write_text(head + body)
    return root


def _lm_eval_python() -> Path:
    try:
        return ensure_lm_eval()
    except (BuildError, OSError) as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"lm-eval cannot be installed here: {exc}")


@pytest.mark.slow
def test_lm_eval_runs_against_the_server(server: RunningServer, tmp_path: Path) -> None:
    python = _lm_eval_python()
    tokenizer = tmp_path / "tokenizer"
    build_tokenizer().save_pretrained(tokenizer)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _tasks(tasks)
    # Offline: the dataset is local and nothing may come from a model hub.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [str(python), "-c", DRIVER, server.base_url, str(tokenizer), str(tasks)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    results = json.loads(line.removeprefix("RESULTS "))
    assert 0 <= results["completions"]["quire_mc"]["acc,none"] <= 1
    assert "exact_match,none" in results["completions"]["quire_gen"]
    assert "exact_match,none" in results["chat"]["quire_gen"]
