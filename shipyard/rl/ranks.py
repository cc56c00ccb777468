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

**Start-up and failure.** Rank 0 loads its model (a model fetched or converted on first use is then cached for the
others), then starts the other ranks as subprocesses; each loads it, reports ready (a file in a private 0700
directory) and only then joins the process group (a `FileStore` there), so a rank that fails to load fails the
start with its message instead of leaving rank 0 waiting in a collective. Operations travel on a
control group of their own (gloo, `CONTROL_TIMEOUT`: the other ranks wait there while rank 0 collects rollouts, which
can take long), the trainer's collectives on the default group (`COLLECTIVE_TIMEOUT`: no collective legitimately
waits that long). A rank that dies closes its connections, rank 0's next collective raises, and the error names the
rank and its exit code (`RankError`, chained to the collective's error). The other ranks die with rank 0
(`shipyard.lifetime.die_with_parent`: PR_SET_PDEATHSIG, set before anything is imported, and a check that rank 0 still
is their parent), so a `kill -9` of `shipyard train` leaves no rank behind; on a clean end rank 0 sends "stop" and
waits for them. All ranks are local processes, so gloo is bound to the loopback interface (`GLOO_SOCKET_IFNAME=lo`
unless set): nothing on the network can reach the sockets whose messages the ranks unpickle.

**Devices.** `run.device = "cpu"`: every rank on the CPU (gloo); ranks 1..N−1 use cores / N threads each (rank 0
keeps its threads for the engine). `"cuda"`: rank r on `cuda:r` (checked against the visible GPUs first), NCCL for
tensors, gloo for the control group. The full weights a step's push, checkpoint and export need are gathered
once, to rank 0 alone, tensor by tensor into its CPU memory (`Trainer.full_state_dict`): no GPU holds a second full
copy of the model.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from shipyard.errors import UserError
from shipyard.lifetime import die_with_parent, popen
from shipyard.models.dtype import resolve_dtype
from shipyard.rl.config import ConfigError, RLConfig
from shipyard.train.trainer import TrainConfig, Trainer

CONTROL_TIMEOUT = timedelta(hours=24)  # ranks 1..N−1 waiting for rank 0's next operation (rollouts, evaluations)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # one trainer collective (a step's all-gathers, a checkpoint's barriers)
READY_SECONDS = 1800.0  # loading a model on every rank

T = TypeVar("T")
_RANK = "import sys; from shipyard.rl.ranks import main; main(sys.argv[1:])"  # not -m: one copy of this module


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

    @classmethod
    def of(cls, config: RLConfig, pad_id: int, header_ids: Sequence[int]) -> RankSpec:
        """The spec of a run's trainer, its `compute_dtype = "auto"` resolved once, here, for rank 0's device: every
        rank then trains in one dtype (GPUs of two generations would otherwise choose apart), and a LoRA base loads
        straight in it (`TrainConfig.load_dtype`) instead of in float32 first, which doubled the peak memory of the
        load (a 7B base: ~28 GB where 14 GB does)."""
        trainer = config.trainer
        if trainer.compute_dtype == "auto":
            device = rank_device(config.run.device, 0, config.run.world_size)
            trainer = replace(trainer, compute_dtype=resolve_dtype("auto", device))
        return cls(config.model.name, config.run.device, trainer, pad_id, tuple(header_ids), config.run.world_size)


@dataclass
class RankGroup:
    """What `trainer_ranks` gives rank 0: its model (float32; with LoRA in the frozen base's dtype, `TrainConfig.
    load_dtype`) and device for its `Trainer`, and the control group the operations travel on (None at world size 1)."""

    model: nn.Module
    device: str
    control: Any = None

    def ranks(self, trainer: Trainer) -> TrainerRanks:
        return TrainerRanks(trainer, self.control)


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
    result. `op` must be a module-level function (it is pickled by name for the other ranks). One caller at a time
    (the loop awaits each operation before the next)."""

    def __init__(self, trainer: Trainer, control: Any = None):
        self.trainer, self.control = trainer, control

    def __call__(self, op: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.trainer.world > 1:
            dist.broadcast_object_list([(op, args, kwargs)], src=0, group=self.control)
        return op(self.trainer, *args, **kwargs)


def follow(trainer: Trainer, control: Any) -> None:
    """Ranks 1..N−1: run rank 0's operations until it says stop (None)."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        if message[0] is None:
            return
        op, args, kwargs = message[0]
        op(trainer, *args, **kwargs)


def _load(spec: RankSpec, device: str, status: Callable[[str], None]) -> nn.Module:
    from shipyard.models.resolve import load_hf

    return load_hf(spec.model, device=device, dtype=spec.trainer.load_dtype, status=status)[0]


def _join(work: Path, spec: RankSpec, rank: int, device: str) -> Any:
    """Join the process group (FileStore in `work`) and the control group; the control group."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), store=dist.FileStore(str(work / "store"), spec.world), rank=rank,
                            world_size=spec.world, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


@contextmanager
def trainer_ranks(spec: RankSpec, status: Callable[[str], None] = lambda _: None) -> Iterator[RankGroup]:
    """Rank 0's side (module docstring): load rank 0's model (so that ranks 1..N−1 find a model that is fetched or
    converted on first use in the cache, instead of all converting it at once), start them, wait until each has
    loaded it, join the process group with them. On a clean exit the ranks are told to stop and waited for; on
    an error they are killed, and a rank that had died is named. World size 1: the model only (the trainer makes
    its own process group of one)."""
    device = rank_device(spec.device, 0, spec.world)
    if spec.world == 1:
        yield RankGroup(_load(spec, device, status), device)
        return
    if device.startswith("cuda") and torch.cuda.device_count() < spec.world:  # a config error: one line from the CLI
        raise ConfigError(f"run.world_size = {spec.world} with run.device = \"cuda\" needs {spec.world} GPUs; "
                          f"{torch.cuda.device_count()} visible: lower run.world_size or train on \"cpu\"")
    if dist.is_initialized():
        raise RankError(f"run.world_size = {spec.world} needs a process without a torch.distributed process group "
                        f"(this one has {dist.get_world_size()} ranks): run `shipyard train` in its own process")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is local (module docstring)
    work = Path(tempfile.mkdtemp(prefix="shipyard-ranks-"))  # 0700: the spec and the store are private
    procs: list[subprocess.Popen] = []
    try:
        (work / "spec.pkl").write_bytes(pickle.dumps(spec))
        model = _load(spec, device, status)  # first: a model fetched or converted on first use is then in the cache
        # a rank dies with rank 0 (SIGKILL: it holds nothing to clean up), tied before its slow imports (torch)
        procs = [popen(die_with_parent([sys.executable, "-c", _RANK, str(work), str(rank)], signal.SIGKILL),
                       stdin=subprocess.DEVNULL) for rank in range(1, spec.world)]
        _wait_ready(work, procs)
        control = _join(work, spec, 0, device)
        yield RankGroup(model, device, control)
    except BaseException as e:
        dead = _died(procs, wait=3.0)
        if dead and not isinstance(e, UserError):  # a user's error (a full disk) ends every rank alike: say it once
            raise RankError(f"trainer rank(s) died (rank, exit code; negative: killed by that signal): {dead}; "
                            f"what a rank printed is above") from e
        raise
    else:
        try:
            dist.broadcast_object_list([None], src=0, group=control)
        except Exception as e:
            raise RankError(f"trainer ranks could not be stopped (rank, exit code): {_died(procs, 3.0)}") from e
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        failed = [(rank, p.returncode) for rank, p in enumerate(procs, 1) if p.returncode]
        if failed:
            raise RankError(f"trainer ranks ended with errors (rank, exit code): {failed}; their messages are above")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)


def _died(procs: list[subprocess.Popen], wait: float) -> list[tuple[int, int]]:
    """(rank, exit code) of the ranks that exited on their own with an error, given `wait` seconds to do so (a rank
    whose peer failed exits moments later)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs):
            break
        time.sleep(0.05)
    return [(rank, p.returncode) for rank, p in enumerate(procs, 1) if p.poll() is not None and p.returncode]


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


def main(argv: list[str]) -> None:
    """A trainer rank (started by `trainer_ranks`, tied to rank 0 by `die_with_parent`): WORKDIR RANK."""
    work, rank = Path(argv[0]), int(argv[1])
    spec: RankSpec = pickle.loads((work / "spec.pkl").read_bytes())
    device = rank_device(spec.device, rank, spec.world)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    model = _load(spec, device, lambda _: None)
    (work / f"ready-{rank}").touch()
    control = _join(work, spec, rank, device)
    try:
        follow(Trainer(model, spec.trainer, pad_id=spec.pad_id, header_ids=spec.header_ids, device=device), control)
    finally:
        dist.destroy_process_group()
