"""lm-eval (a real client) through the router equals the same run against the mixed worker:
a multiple_choice task (loglikelihoods: echo + logprobs, batched prompts) and a generate_until
task, `--batch_size 4`, both written here (no hub), the tokenizer the servers' own
(`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize).

lm-eval is heavy (datasets, pyarrow, scikit-learn) and pins its own dependencies: it lives in a
virtualenv of its own that `make test-clients` installs (LM_EVAL below); without it the test
is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.pd.conftest import MODEL, PDCluster
from tests.repo import REPO_ROOT

LM_EVAL = Path(os.environ.get("PDROUTER_LM_EVAL", REPO_ROOT / ".venv-lmeval" / "bin" / "lm_eval"))
TOLERANCE = 1e-4

CHOICE_DOCS = [
    {"question": "The opposite of up is", "choices": [" down", " left", " blue"], "answer": 0},
    {"question": "Two plus two is", "choices": [" three", " four", " five"], "answer": 1},
    {"question": "import os; os.path.", "choices": ["join", "walk", "zzz"], "answer": 0},
    {"question": "A list in Python is", "choices": [" mutable", " frozen"], "answer": 0},
    {"question": "def f(x): return", "choices": [" x", " y", " None"], "answer": 0},
    {"question": "for i in", "choices": [" range(3):", " nothing", " ???"], "answer": 0},
]
GEN_DOCS = [{"question": q, "answer": "x"} for q in
            ("Say hi:", "The module os", "print(", "A dict maps", "class A:")]  # fmt: skip

CHOICE_TASK = """task: pdr_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: pdr_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _tasks(folder: Path) -> Path:
    folder.mkdir()
    for name, docs, task in (("choice", CHOICE_DOCS, CHOICE_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(task.format(path=data))
    return folder


def _run(base_url: str, tasks: Path, out: Path) -> dict[str, list[dict[str, Any]]]:
    """lm_eval against base_url; each task's samples, by doc id."""
    args = f"base_url={base_url}/v1/completions,model={MODEL},tokenizer_backend=remote"
    argv = [str(LM_EVAL), "--model", "local-completions", "--model_args", args,
            "--tasks", "pdr_choice,pdr_gen", "--include_path", str(tasks), "--batch_size", "4",
            "--output_path", str(out), "--log_samples"]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in ("pdr_choice", "pdr_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return samples


@pytest.mark.slow
@pytest.mark.skipif(not LM_EVAL.exists(), reason="lm-eval is installed by make test-clients")
def test_lm_eval_through_pd_equals_mixed(pd_cluster: PDCluster, tmp_path: Path) -> None:
    tasks = _tasks(tmp_path / "tasks")
    pd = _run(pd_cluster.router_url, tasks, tmp_path / "pd")
    mixed = _run(pd_cluster.mixed_url, tasks, tmp_path / "mixed")
    assert len(pd["pdr_choice"]) == len(CHOICE_DOCS) and len(pd["pdr_gen"]) == len(GEN_DOCS)
    for a, b in zip(pd["pdr_choice"], mixed["pdr_choice"], strict=True):
        # one [loglikelihood, is_greedy] per choice
        assert len(a["resps"]) == len(CHOICE_DOCS[a["doc_id"]]["choices"])
        for (lp_a, greedy_a), (lp_b, greedy_b) in (
            (x[0], y[0]) for x, y in zip(a["resps"], b["resps"], strict=True)
        ):
            assert abs(float(lp_a) - float(lp_b)) < TOLERANCE and float(lp_a) < 0
            assert greedy_a == greedy_b
        assert a["acc"] == b["acc"]
    for a, b in zip(pd["pdr_gen"], mixed["pdr_gen"], strict=True):
        assert a["resps"] == b["resps"] and a["resps"][0][0]  # generated text, equal
