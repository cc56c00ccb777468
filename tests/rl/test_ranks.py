"""Trainer ranks under failure (`shipyard.rl.ranks`): a rank that dies mid-run fails rank 0 with an error naming it
(never a hang), and a rank 0 killed with SIGKILL takes its ranks with it. Each test drives a real 2-rank group (the
tiny model, gloo on 127.0.0.1) from a subprocess it owns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from servers import alive, wait_for

DRIVER = textwrap.dedent("""
    import sys, time
    from shipyard.rl.ranks import RankSpec, trainer_ranks
    from shipyard.train.trainer import TrainConfig, Trainer

    spec = RankSpec("random:tiny", "cpu", TrainConfig(), 0, (), 2)
    with trainer_ranks(spec) as group:
        trainer = Trainer(group.model, spec.trainer, pad_id=0, device=group.device)
        ranks = group.ranks(trainer)
        ranks(Trainer.full_state_dict)
        print("ready", flush=True)
        for _ in range(int(sys.argv[1])):
            ranks(Trainer.full_state_dict)
            time.sleep(0.05)
    print("done", flush=True)
""")


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def start(iterations: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(iterations)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        pytest.fail(f"the 2-rank group did not start: {proc.communicate()[1][-3000:]}")
    return proc


def test_a_clean_end_stops_the_ranks():
    proc = start(3)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "done", err[-3000:]


def test_a_rank_that_dies_fails_rank_0_with_its_name_not_a_hang():
    proc = start(10_000)
    try:
        (rank,) = children(proc.pid)
        os.kill(rank, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "RankError" in err and "(1, -9)" in err, err[-3000:]


def test_ranks_die_with_a_killed_rank_0():
    proc = start(10_000)
    (rank,) = children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    if not wait_for(lambda: not alive(rank), 30):
        os.kill(rank, signal.SIGKILL)
        pytest.fail("a trainer rank outlived rank 0 by 30 s")


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 2, reason="this host has the GPUs")
def test_more_gpu_ranks_than_gpus_is_a_config_error():
    from shipyard.rl.config import ConfigError
    from shipyard.rl.ranks import RankSpec, trainer_ranks
    from shipyard.train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="needs 2 GPUs"), trainer_ranks(RankSpec("random:tiny", "cuda", TrainConfig(),
                                                                                  0, (), 2)):
        pass


def test_a_runs_auto_dtype_is_resolved_once_so_a_lora_base_loads_in_it():
    """`RankSpec.of` resolves `compute_dtype = "auto"` for rank 0's device: every rank gets the same dtype, and a LoRA
    base loads straight in it (bf16 where native) rather than in float32 first (twice the memory at load)."""
    from dataclasses import replace

    import torch

    from shipyard.models.dtype import native_bfloat16
    from shipyard.models.lora import LoraConfig
    from shipyard.rl.config import RLConfig
    from shipyard.rl.ranks import RankSpec, trainer_ranks

    config = RLConfig()
    config = replace(config, model=replace(config.model, name="random:tiny"),
                     trainer=replace(config.trainer, compute_dtype="auto", lora=LoraConfig(enabled=True, rank=2)))
    spec = RankSpec.of(config, 0, [5, 6])
    native = native_bfloat16("cpu")
    assert spec.trainer.compute_dtype == ("bfloat16" if native else "float32")
    assert spec.header_ids == (5, 6) and spec.world == 1
    with trainer_ranks(spec) as group:
        assert {p.dtype for p in group.model.parameters()} == {torch.bfloat16 if native else torch.float32}
    explicit = RankSpec.of(replace(config, trainer=replace(config.trainer, compute_dtype="float32")), 0, ())
    assert explicit.trainer.compute_dtype == "float32"
