"""NCCL weight pushes (`shipyard.models.nccl`, `[vllm] transfer = "nccl"`): what runs without a GPU.

A push itself needs two GPUs (NCCL refuses two ranks on one device) and a CUDA build of vLLM: that test is
`tests/models/test_vllm_nccl.py`, skipped elsewhere. Here: the push is checked and held before any server is
touched, the bodies of the routes are what vLLM 0.32 parses (by vLLM's own dataclasses, in its venv: marked `vllm`,
so `.ci/run`'s vLLM stage runs it), the servers are started for it, and every setting that cannot work is refused
before minutes of server start-up. The control flow of a push is tested against the fake server in
tests/models/test_vllm_hostile.py.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shipyard.errors import UsageError, UserError
from shipyard.models.engine import VersionConflict
from shipyard.models.lora import LoraConfig
from shipyard.models.nccl import TorchNccl, init_payload, update_payload
from shipyard.models.vllm_server import VLLMConfig, VLLMServers, managed_engine
from shipyard.models.weightdir import PushRejected, TensorSpec, WeightDir

SPEC = {"model.embed_tokens.weight": TensorSpec((8, 4), torch.bfloat16),
        "model.norm.weight": TensorSpec((4,), torch.float16)}


def _tensors(**changes):
    tensors = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    return {**tensors, **changes}


def _held(tmp_path, version, tensors):
    return WeightDir(tmp_path / "w", SPEC).hold(version, tensors)


def test_a_push_is_checked_whole_and_held_once_per_version_before_any_server_is_touched(tmp_path):
    weights = WeightDir(tmp_path / "w", SPEC)
    held = weights.hold(3, _tensors())
    assert list(held) == list(SPEC) and [t.dtype for t in held.values()] == [torch.bfloat16, torch.float16]
    assert weights.hold(3, _tensors()) is held  # every server's push, and a restarted server's, from one copy
    assert weights.held == (3, held) and not list((tmp_path / "w").iterdir())  # nothing written
    with pytest.raises(VersionConflict):
        weights.hold(2, _tensors())
    assert update_payload(held)["update_info"] == {"names": list(SPEC), "dtype_names": ["bfloat16", "float16"],
                                                   "shapes": [[8, 4], [4]]}
    tied = _tensors()
    tied["lm_head.weight"] = tied["model.embed_tokens.weight"]  # a tied head's second name: not sent
    assert list(_held(tmp_path, 1, tied)) == list(SPEC)
    bad = {"missing": {k: v for k, v in _tensors().items() if k != "model.norm.weight"},
           "shape": _tensors(**{"model.norm.weight": torch.ones(5)}),
           "floating-point": _tensors(**{"model.norm.weight": torch.ones(4, dtype=torch.int64)}),
           "non-finite": _tensors(**{"model.norm.weight": torch.tensor([1.0, 1.0, 1.0, float("nan")])}),
           "unknown": _tensors(**{"extra": torch.ones(1)})}
    for why, tensors in bad.items():
        with pytest.raises(PushRejected, match=why):
            _held(tmp_path, 1, tensors)
    # finite in float32, infinite once cast to the served float16: refused as the server would receive it
    with pytest.raises(PushRejected, match="non-finite"):
        _held(tmp_path, 1, _tensors(**{"model.norm.weight": torch.full((4,), 1e6)}))
    with pytest.raises(PushRejected):
        weights.hold(4, {**_tensors(), "model.norm.weight": torch.ones(5)})
    assert weights.kept() == (3, held)  # a rejected push keeps the copy the servers hold


@pytest.mark.vllm
def test_the_route_bodies_are_what_vllm_parses(tmp_path):
    """The init and update bodies built by vLLM's own dataclasses, in vLLM's venv: the unique id decodes to NCCL's
    128 bytes, the trainer is rank 0 and the workers follow it."""
    from vllm_venv import PYTHON

    if not os.access(PYTHON, os.X_OK):
        if os.environ.get("SHIPYARD_REQUIRE_VLLM"):
            raise RuntimeError(f"$SHIPYARD_REQUIRE_VLLM is set but {PYTHON} is not vLLM's venv python")
        pytest.skip(f"no vLLM venv at {PYTHON}")
    unique_id = bytes(range(128))
    bodies = {"init": init_payload(unique_id, 2)["init_info"],
              "update": update_payload(WeightDir(tmp_path / "w", SPEC).hold(1, _tensors()))["update_info"]}
    script = ("import json, sys\n"
              "from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo as I, "
              "NCCLWeightTransferUpdateInfo as U\n"
              "b = json.load(sys.stdin)\n"
              "i, u = I(**b['init']), U(**b['update'])\n"
              "print(json.dumps({'id': list(i.nccl_unique_id_bytes), 'rank_offset': i.rank_offset, "
              "'world': i.world_size, 'packed': i.packed, 'names': u.names, 'dtypes': u.dtype_names}))\n")
    out = subprocess.run([str(PYTHON), "-c", script], input=json.dumps(bodies), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {"id": list(unique_id), "rank_offset": 1, "world": 3, "packed": False, "names": list(SPEC),
                      "dtypes": ["bfloat16", "float16"]}
    assert base64.b64decode(bodies["init"]["nccl_unique_id_b64"], validate=True) == unique_id  # standard base64


def test_servers_for_nccl_pushes_are_started_for_them_and_impossible_settings_are_refused_before(tmp_path):
    any_python = Path(sys.executable)  # the command is only built: no server runs, so vLLM's venv need not exist
    config = VLLMConfig(python=any_python, gpus=(4, 5), gpus_per_server=1, servers=2, transfer="nccl",
                        max_model_len=64)
    assert config.nccl_workers == 1 and VLLMConfig(gpus=(4,)).nccl_workers == 0
    cmd = VLLMServers(config, tmp_path, tmp_path / "logs").command(tmp_path / "0.sock")
    flag = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[flag + 1]) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in VLLMServers(VLLMConfig(python=any_python, max_model_len=64), tmp_path,
                                                         tmp_path / "l").command(tmp_path / "0.sock")
    with pytest.raises(ValueError, match="\"disk\" or \"nccl\""):
        VLLMConfig(transfer="ipc")
    with pytest.raises(ValueError, match="servers on GPUs"):
        VLLMConfig(transfer="nccl")  # CPU servers
    # refused before any server starts (no server python is even looked at: a missing one would fail later)
    from vllm_venv import served_model

    served_model(tmp_path / "model")
    config = VLLMConfig(python=tmp_path / "none", gpus=(1,), transfer="nccl", max_model_len=64)
    with pytest.raises(UsageError, match="LoRA run pushes its adapter"), \
            managed_engine(config, tmp_path / "model", tmp_path / "run", None, lora=LoraConfig(enabled=True)):
        pass
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="sees none"), managed_engine(config, tmp_path / "model",
                                                                          tmp_path / "run", None):
            pass
        with pytest.raises(UserError, match="sees none"):
            TorchNccl("unix:/nowhere")
