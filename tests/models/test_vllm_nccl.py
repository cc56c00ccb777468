"""NCCL weight pushes into a real vLLM server on a GPU (`[vllm] transfer = "nccl"`, `shipyard.models.nccl`).

Needs two CUDA GPUs — NCCL refuses two ranks on one device: the trainer (this process) broadcasts from cuda:0 to a
server on GPU 1 — and a CUDA build of vLLM in the vLLM venv (`VLLM_PACKAGE=vllm bash scripts/install-vllm.sh`).
Skipped elsewhere, saying which is missing. Marked `vllm`, like the CPU server tests it mirrors: the served logprobs
after a push are the pushed model's (a tied head included), a push that does not fit leaves the old version serving,
and the server's workers really joined the group (a second push through the same group).
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from test_vllm import PROMPT, greedy, model, reference_logprobs
from vllm_venv import served_model, vllm_python

from shipyard.models.vllm_server import VLLMConfig, managed_engine
from shipyard.models.weightdir import PushRejected

pytestmark = pytest.mark.vllm

PYTHON = vllm_python()
if torch.cuda.device_count() < 2:
    pytest.skip(f"an NCCL push needs 2 CUDA GPUs (the trainer's and the server's); this machine has "
                f"{torch.cuda.device_count()}", allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    probe = subprocess.run([str(PYTHON), "-c", "import torch, vllm; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=300)
    if probe.stdout.strip().splitlines()[-1:] != ["True"]:
        pytest.skip(f"the vLLM venv at {PYTHON} is not a CUDA build (VLLM_PACKAGE=vllm bash scripts/install-vllm.sh)")
    root = tmp_path_factory.mktemp("vllm-nccl")
    tok = served_model(root / "model")
    torch.cuda.set_device(0)
    config = VLLMConfig(python=str(PYTHON), gpus=(1,), transfer="nccl", max_model_len=1024)
    with managed_engine(config, root / "model", root / "run", tok) as e:
        yield e


def test_an_nccl_push_makes_the_served_logprobs_the_pushed_models(engine):
    for version, seed in ((1, 1), (2, 2)):
        pushed = model(seed)
        engine.update_weights(version, {k: v.cuda() for k, v in pushed.state_dict().items()})
        c = greedy(engine)
        assert c.policy_version == version
        assert c.logprobs == pytest.approx(reference_logprobs(pushed, PROMPT, c.token_ids), abs=0.03)
    assert engine.last_push.bytes > 0


def test_a_push_that_does_not_fit_is_refused_before_the_broadcast_and_the_old_version_serves(engine):
    before = greedy(engine)
    bad = model(9).state_dict()
    bad[next(iter(bad))] = torch.full_like(bad[next(iter(bad))], float("nan"))
    with pytest.raises(PushRejected, match="non-finite"):
        engine.update_weights(engine.policy_version + 1, bad)
    after = greedy(engine)
    assert after.policy_version == before.policy_version and after.token_ids == before.token_ids
    engine.update_weights(engine.policy_version + 1, model(3).state_dict())  # the group still works
    assert greedy(engine).logprobs == pytest.approx(reference_logprobs(model(3), PROMPT, greedy(engine).token_ids),
                                                    abs=0.03)
