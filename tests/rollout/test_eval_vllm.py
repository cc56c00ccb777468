"""`shipyard eval --model vllm:MODEL`: an evaluation sampled by a vLLM server that the eval starts for the model and
stops when it ends — what `bench learning` evaluates every arm with where vLLM is installed, so that its arms are
sampled as its RL stages are (`engine.kind = "vllm"`).

The missing-venv test runs everywhere; the real-server test is marked `vllm` (docs/testing.md), as are the other tests
against real servers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from servers import needs_sandbox

from shipyard.errors import UsageError
from shipyard.models.vllm_server import VLLMConfig


def test_a_vllm_engine_without_vllms_venv_says_how_to_make_one(tmp_path, monkeypatch):
    from shipyard.models.resolve import make_engine

    monkeypatch.setenv("SHIPYARD_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(UsageError, match=r"install-vllm\.sh.*SHIPYARD_VLLM_PYTHON"):
        make_engine(f"vllm:{tmp_path}")
    # a run's [vllm] python is checked before the model is converted or fetched from the hub
    with pytest.raises(UsageError, match=r"vllm\.python .*SHIPYARD_VLLM_PYTHON.*install-vllm\.sh"):
        make_engine("vllm:Org/Big-Model", vllm=VLLMConfig(python=tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("SHIPYARD_VLLM_PYTHON", sys.executable)
    with pytest.raises(Exception, match="names no model"):
        make_engine("vllm:")


def eval_cli(tasks, task, model, out, rollouts, *extra):
    return subprocess.run([sys.executable, "-m", "shipyard.cli", "eval", "--tasks", str(tasks), "--task", task,
                           "--model", model, "--samples", "2", "--episode.loop.max_turns", "2",
                           "--episode.loop.max_new_tokens", "24",
                           "--concurrency", "2", "--out", str(out), "--rollouts", str(rollouts), *extra],
                          capture_output=True, text=True, timeout=900)


@pytest.mark.vllm
@needs_sandbox
def test_an_eval_on_a_vllm_server_of_the_model_resumes_under_the_same_engine(taskset, tmp_path, source_copy,
                                                                           monkeypatch):
    from vllm_venv import served_model, vllm_python

    monkeypatch.setenv("SHIPYARD_VLLM_PYTHON", str(vllm_python()))  # the subprocesses find vLLM there
    tasks_dir, _, _ = taskset
    task = sorted(p.name for p in tasks_dir.iterdir() if (p / "task.json").is_file())[0]
    served_model(tmp_path / "model")
    model = f"vllm:{tmp_path / 'model'}"
    journal = tmp_path / "r.jsonl"
    first = eval_cli(tasks_dir, task, model, tmp_path / "a.json", journal)
    assert first.returncode == 0, first.stderr[-3000:]
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["config"]["model"] == model and doc["config"]["engine"] == model  # named by what it serves
    assert doc["overall"]["scored"] == 2 and doc["overall"]["masked"] == 0
    lines = journal.read_text().splitlines()
    journal.write_text(lines[0] + "\n")  # stopped after its first rollout
    again = eval_cli(tasks_dir, task, model, tmp_path / "b.json", journal, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((tmp_path / "b.json").read_text())
    assert resumed["config"]["resumed_rollouts"] == 1 and resumed["overall"]["scored"] == 2
    assert len(journal.read_text().splitlines()) == 2
    left = subprocess.run(["pgrep", "-f", f"--model {tmp_path / 'model'}"], capture_output=True, text=True).stdout
    assert left == "", "the eval's vLLM server outlived it"
