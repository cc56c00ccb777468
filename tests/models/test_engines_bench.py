"""`shipyard bench engine -- --engines ...`: the loop's samplers side by side on one workload (shipyard/bench/
_engines.py), and `shipyard bench sync -- --engine vllm`: pushes to a vLLM server, full and LoRA (_sync_vllm.py). The
in-process engine alone runs in the default suite; with vLLM's venv (`-m vllm`), real servers of a tiny random
model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm_venv import served_model

SMALL = ["--concurrency", "1,2", "--prompt-tokens", "64", "--new-tokens", "8", "--rounds", "1"]


def bench(model_dir, *args):
    return subprocess.run([sys.executable, "-m", "shipyard.cli", "bench", "engine", "--", "--model", str(model_dir),
                           *SMALL, *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines") / "model"
    served_model(root)
    return root


def test_the_local_engine_alone_is_measured_at_each_concurrency(model_dir):
    proc = bench(model_dir, "--engines", "local")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "engine" and doc["engines"] == ["local"]
    assert sorted(doc["tokens_per_s"]["local"]) == ["1", "2"] and all(v > 0 for v in doc["tokens_per_s"]["local"]
                                                                        .values())
    assert doc["ratio"] == {} and doc["target_met"] is False  # nothing to compare: the target is not met
    assert "local at concurrency 2: 16 tokens" in proc.stdout  # both threads sampled their 8 tokens


def test_an_unknown_engine_is_refused(model_dir):
    proc = bench(model_dir, "--engines", "local,sglang")
    assert proc.returncode != 0 and "--engines names engines among local and vllm" in proc.stderr


@pytest.mark.vllm
def test_local_and_vllm_side_by_side(model_dir):
    from vllm_venv import vllm_python

    proc = bench(model_dir, "--engines", "local,vllm", "--vllm-python", str(vllm_python()), "--kv-cache-gib", "1")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["engines"] == ["local", "vllm"] and sorted(doc["ratio"]) == ["1", "2"]
    for c in ("1", "2"):  # the ratio is the two figures' quotient; both sampled every planned token (else exit 1)
        assert doc["ratio"][c] == pytest.approx(doc["tokens_per_s"]["vllm"][c] / doc["tokens_per_s"]["local"][c],
                                                rel=1e-2)
    assert doc["target_met"] == (doc["ratio"]["2"] >= 1.5)


@pytest.mark.vllm
def test_pushes_to_vllm_full_and_lora(model_dir):
    """`bench sync -- --engine vllm`: both kinds pushed and sampled after (else the bench exits 1), figures and targets
    in the JSON."""
    from vllm_venv import vllm_python

    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "bench", "sync", "--", "--engine", "vllm", "--model",
                           str(model_dir), "--lora-rank", "8", "--pushes", "2", "--vllm-python", str(vllm_python())],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["engine"] == "vllm" and doc["full"]["pushes"] == doc["lora"]["pushes"] == 4
    assert 0 < doc["lora"]["bytes"] < doc["full"]["bytes"] and doc["lora_bytes_fraction"] == pytest.approx(
        doc["lora"]["bytes"] / doc["full"]["bytes"], rel=1e-3)
    assert all(doc[k]["push_s"] >= doc[k]["server_s"] > 0 for k in ("full", "lora"))
    assert set(doc["target_met"]) == {"full_seconds", "lora_seconds", "lora_bytes_fraction"}
