"""Trainer ranks for `shipyard train` with `run.world_size` = N > 1: the loop's process is rank 0, and N − 1 trainer
processes beside it hold the other shards of an FSDP2 trainer.

    rank 0: curriculum, scheduler, engines, sandboxes, run directory, its Trainer shard
       │  broadcast (operation, arguments) before every trainer collective
       ▼
    ranks 1..N−1 (`python -m shipyard.rl.ranks`): a Trainer shard, nothing else — `follow` runs each operation

The trainer is SPMD (`shipyard.train.trainer`: every rank is given the same global batch and takes its share), so
the loop needs no second code path: every call it makes on the trainer that involves the other ranks — a step, the
full weights for the engines or the export, saving or loading a checkpoint — goes through `TrainerRanks`, which
broadcasts the operation (a module-level function and its arguments, pickled) from rank 0 and runs it there too; at
world size 1 it only runs it. The batch crosses as part of the step's arguments (token ids and floats: small next
to the weights). Checkpoints are `torch.distributed.checkpoint`, so a run resumes on any number of ranks
(`--run.world_size M --run.resume true`).

**Start-up and failure.** Rank 0 starts the other ranks as subprocesses; each loads the model, reports ready (a file
in a private 0700 directory) and only then joins the process group (a `FileStore` there), so a rank that fails to
load fails the start with its message instead of leaving rank 0 waiting in a collective. A rank that dies later
closes its gloo connections and rank 0's next collective raises. The other ranks die with rank 0 (`PR_SET_PDEATHSIG`),
so a `kill -9` of `shipyard train` leaves nothing behind; on a clean end rank 0 broadcasts "stop" and waits for them.

**Devices.** `run.device = "cpu"`: every rank on the CPU (gloo). `"cuda"`: rank r on `cuda:r`, gloo for objects and
NCCL for tensors.
"""

from __future__ import annotations

import ctypes
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from shipyard.train.trainer import TrainConfig, Trainer

# Ranks 1..N−1 wait in a broadcast while rank 0 collects the next batch (rollouts can take many minutes); a dead rank
# 0 is noticed through its closed connections or PR_SET_PDEATHSIG, not through this timeout.
RANK_TIMEOUT = timedelta(hours=12)
READY_SECONDS = 1800.0  # loading a model on every rank

T = TypeVar("T")


class RankError(RuntimeError):
    """A trainer rank failed to start or died."""


@dataclass(frozen=True)
class RankSpec:
    """What a trainer rank needs to build its shard of rank 0's trainer."""

    model: str
    device: str
    trainer: TrainConfig
    pad_id: int
    header_ids: tuple[int, ...]
    world: int


def rank_device(device: str, rank: int, world: int) -> str:
    """The device of `rank`: the CPU, or one GPU per rank for `cuda`."""
    if world == 1 or device == "cpu":
        return device
    if device == "cuda":
        return f"cuda:{rank}"
    raise ValueError(f"run.device = {device!r} with run.world_size = {world}: give \"cuda\" (rank r uses cuda:r) or "
                     f"\"cpu\"")


def _backend(device: str) -> str:
    return "gloo" if torch.device(device).type == "cpu" else "cpu:gloo,cuda:nccl"


class TrainerRanks:
    """Rank 0's handle on the trainer: `ranks(op, *args)` runs `op(trainer, *args)` on every rank and returns rank 0's
    result. `op` must be a module-level function (it is pickled by name for the other ranks)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def __call__(self, op: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.trainer.world > 1:
            dist.broadcast_object_list([(op, args, kwargs)], src=0)
        return op(self.trainer, *args, **kwargs)


def follow(trainer: Trainer) -> None:
    """Ranks 1..N−1: run rank 0's operations until it says stop (None)."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return
        op, args, kwargs = message[0]
        op(trainer, *args, **kwargs)


def _load(spec: RankSpec, device: str, status: Callable[[str], None]) -> nn.Module:
    from shipyard.models.resolve import load_hf

    return load_hf(spec.model, device=device, dtype=torch.float32, status=status)[0]


@contextmanager
def trainer_ranks(spec: RankSpec, status: Callable[[str], None] = lambda _: None) -> Iterator[tuple[nn.Module, str]]:
    """Rank 0's side (module docstring): start ranks 1..N−1, load rank 0's model while they load theirs, wait until
    each is ready, join the process group with them; yields rank 0's (float32 model, device) for its `Trainer`. On a
    clean exit the ranks are told to stop and waited for; on an error they are killed. World size 1: the model only
    (the trainer makes its own process group of one)."""
    device = rank_device(spec.device, 0, spec.world)
    if spec.world == 1:
        yield _load(spec, device, status), device
        return
    if dist.is_initialized():
        raise RankError(f"run.world_size = {spec.world} needs a process without a torch.distributed process group "
                        f"(this one has {dist.get_world_size()} ranks): run `shipyard train` in its own process")
    work = Path(tempfile.mkdtemp(prefix="shipyard-ranks-"))  # 0700: the spec and the store are private
    procs: list[subprocess.Popen] = []
    clean = False
    try:
        (work / "spec.pkl").write_bytes(pickle.dumps(spec))
        procs = [subprocess.Popen([sys.executable, "-m", "shipyard.rl.ranks", str(work), str(rank)],
                                  stdin=subprocess.DEVNULL) for rank in range(1, spec.world)]
        model = _load(spec, device, status)
        _wait_ready(work, procs)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group(_backend(device), store=dist.FileStore(str(work / "store"), spec.world), rank=0,
                                world_size=spec.world, timeout=RANK_TIMEOUT)
        yield model, device
        clean = True
    finally:
        if clean:
            dist.broadcast_object_list([None], src=0)
            for p in procs:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    failed = [(rank, p.returncode) for rank, p in enumerate(procs, 1) if p.returncode]
    if failed:
        raise RankError(f"trainer ranks ended with errors (rank, exit code): {failed}; their messages are above")


def _wait_ready(work: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while not all((work / f"ready-{rank}").exists() for rank in range(1, len(procs) + 1)):
        for rank, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise RankError(f"trainer rank {rank} exited with code {p.returncode} while loading the model; "
                                f"its message is above")
        if time.monotonic() > deadline:
            raise RankError(f"the trainer ranks did not load the model within {READY_SECONDS:.0f} s")
        time.sleep(0.1)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when rank 0 dies, however it died."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> None:
    """A trainer rank: `python -m shipyard.rl.ranks WORKDIR RANK` (started by `trainer_ranks`)."""
    work, rank = Path(argv[0]), int(argv[1])
    _die_with_parent()
    spec: RankSpec = pickle.loads((work / "spec.pkl").read_bytes())
    device = rank_device(spec.device, rank, spec.world)
    model = _load(spec, device, lambda _: None)
    (work / f"ready-{rank}").touch()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), store=dist.FileStore(str(work / "store"), spec.world), rank=rank,
                            world_size=spec.world, timeout=RANK_TIMEOUT)
    try:
        follow(Trainer(model, spec.trainer, pad_id=spec.pad_id, header_ids=spec.header_ids, device=device))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
