"""NCCL weight pushes to vLLM servers on GPUs: the trainer's end of vLLM's weight-transfer engine.

**Why.** A filesystem push (`weightdir`) writes the whole checkpoint every step — 15 GB for a 7B in bf16 — and every
server reads it back. A broadcast from the trainer's GPU over NVLink or PCIe moves the same bytes in a fraction of
that, with no disk in between. vLLM (>= 0.32) receives one on GPU servers started with
`--weight-transfer-config '{"backend": "nccl"}'`, through the routes of `vllm/entrypoints/rl/online/api_router.py`:
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
`/shutdown_weight_transfer_engine`.

**Rendezvous without vLLM in the trainer's venv.** vLLM's own trainer helper joins vLLM's `StatelessProcessGroup`
(its TCPStore protocol), so it needs vLLM importable — and shipyard keeps vLLM in a venv of its own (conflicting
pins). vLLM's other rendezvous mode is for trainers without vLLM: the trainer mints an `ncclUniqueId` and sends it
(`nccl_unique_id_b64`: its 128 bytes in standard base64). PyTorch mints one and opens a communicator on it with
`torch.cuda.nccl` (`unique_id`, `init_rank`, `broadcast`, `all_reduce`) over the same NCCL library. The trainer is
rank 0 and the server's workers ranks 1..W (`rank_offset` 1, W its tensor-parallel size). Every rank must enter
`ncclCommInitRank` together, so the init route is posted on a thread while the trainer opens its end; right after
it, vLLM's workers issue a one-element float32 all-reduce (their warm-up), which the trainer must match before any
other collective.

**One group per server**, not one across all servers: a server that dies breaks its own group only (it is started
again, rejoins with a new id, and serves again from the next push: `vllm_server.ManagedServer`), at the cost of one
broadcast per server from the trainer's GPU.

**A push** (`NcclGroup.send`), between the engine's pause and resume (`shipyard.models.vllm`):

1. the tensors were checked against the served checkpoint and kept on the CPU in its dtypes, once per version for
   every server (`WeightDir.hold`), before any server is touched;
2. `/start_weight_update` (vLLM begins its layerwise reload), then `/update_weights` with the tensors' names, dtypes
   and shapes, while the trainer broadcasts each tensor in that order from its GPU, on a stream of its own, one by
   one (`packed` false: nothing about vLLM's packing has to agree);
3. `/finish_weight_update`.

**Nothing waits unbounded.** What blocks until a peer acts — the rendezvous, the copies and broadcasts (a copy from
pageable memory waits for the broadcast before it), and the two routes vLLM answers only once its workers are done
(`/init_weight_transfer_engine`, `/update_weights`) — runs on daemon threads that the caller watches against
`timeout`; the other routes are plain calls, bounded by the client's timeout. A push is then classified by the
trainer's side:

- both sides done: the push landed;
- the trainer's side completed and the server failed or did not answer in time: its state is unknown, an
  `InfraError` (the engine is broken; a managed server is restarted and given the kept copy,
  `vllm_server.ManagedServer`);
- the trainer's side still waits (the server answered an error or died; nothing completed in time), or it failed:
  NCCL kernels of the trainer's process wait for peers that will not come, and PyTorch offers no way to abort them.
  So it is `TransferWedged`, raised once a resume was tried briefly (a server stuck in the transfer answers none),
  which ends the run saying what to do — start it again: it resumes from its last checkpoint — rather than an
  `InfraError` the loop would retry beside a stuck stream; no server is restarted beside it;
- a rendezvous that fails or times out is `GroupNotFormed`: at start-up an error that says what to check, for a
  restarted server a failed restart.

A group is never destroyed: PyTorch's communicator handle frees nothing (its destructor skips `ncclCommDestroy`),
so each group a restarted server leaves behind holds its buffers until the run ends; there are at most
`max_restarts` per server.

The collective library is a seam (`Collectives`): `TorchNccl` is NCCL through `torch.cuda.nccl`, and the tests run
the same control flow on the CPU with a loopback whose peer is a fake vLLM server (tests/models/fake_vllm.py).
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from shipyard.errors import UserError
from shipyard.models.errors import InfraError
from shipyard.models.openai import RequestRejected, ServerError

POLL = 0.01  # seconds between checks of a transfer's progress
CLOSE_WAIT = 10.0  # seconds a closing run waits for a server to shut its end of the group down
GRACE = 2.0  # seconds one side of a transfer gets to finish once the other failed
ANSWER_SLACK = 30.0  # seconds past the watch's timeout a watched route's HTTP timeout runs
NOT_FOR_LORA = ("vllm.transfer = \"nccl\" pushes full weights; a LoRA run pushes its adapter (megabytes) through the "
                "weights directory: set vllm.transfer = \"disk\"")
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # vLLM: getattr(torch)


class TransferWedged(UserError, RuntimeError):
    """An NCCL transfer that failed half way: the trainer's GPU holds kernels waiting for peers (module docstring)."""


class GroupNotFormed(InfraError, UserError):
    """A rendezvous that failed: at start-up a mistake to fix (the message says what to check); for a server
    restarted mid-run, an infrastructure failure like its restart failing."""


class Collectives(Protocol):
    """The trainer's end of a collective library (module docstring)."""

    def unique_id(self) -> bytes: ...

    def join(self, world: int, unique_id: bytes) -> Any:
        """As rank 0 of `world`: the communicator, once every rank joined and the warm-up all-reduce is done."""

    def broadcast(self, comm: Any, tensor: torch.Tensor) -> None:
        """Send `tensor` (on the CPU, in the dtype to send) from rank 0; may block until the peers receive."""

    def synchronize(self, comm: Any) -> None:
        """Until every broadcast sent on `comm` is complete."""


class TorchNccl:
    """NCCL through `torch.cuda.nccl`, on the current CUDA device, on a stream of its own (module docstring)."""

    def __init__(self, where: str):
        if not torch.cuda.is_available():
            raise UserError(f"vllm.transfer = \"nccl\" broadcasts the weights from the trainer's GPU, and this process "
                            f"sees none (for {where}): run the trainer on GPUs, or set vllm.transfer = \"disk\"")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)

    def unique_id(self) -> bytes:
        return torch.cuda.nccl.unique_id()

    def join(self, world: int, unique_id: bytes) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            comm = torch.cuda.nccl.init_rank(world, unique_id, 0)
            warm = torch.zeros(1, device=self.device)  # vLLM's warm-up: one float32, summed
            torch.cuda.nccl.all_reduce([warm], streams=[self.stream], comms=[comm])
            self.stream.synchronize()
        return comm

    def broadcast(self, comm: Any, tensor: torch.Tensor) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            value = tensor.to(self.device)  # allocated on this stream: reused only after the broadcast, in its order
            torch.cuda.nccl.broadcast([value], root=0, streams=[self.stream], comms=[comm])

    def synchronize(self, comm: Any) -> None:
        self.stream.synchronize()


def init_payload(unique_id: bytes, workers: int) -> dict:
    """The body of `/init_weight_transfer_engine` for a server of `workers` GPUs joining the trainer's rank 0
    (vLLM's `NCCLWeightTransferInitInfo`, unique-id mode)."""
    return {"init_info": {"rank_offset": 1, "world_size": workers + 1, "packed": False,
                          "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii")}}


def update_payload(tensors: Mapping[str, torch.Tensor]) -> dict:
    """The body of `/update_weights`: what the workers receive, in the order it is broadcast (vLLM's
    `NCCLWeightTransferUpdateInfo`)."""
    return {"update_info": {"names": list(tensors), "dtype_names": [DTYPE_NAMES[t.dtype] for t in tensors.values()],
                            "shapes": [list(t.shape) for t in tensors.values()]}}


def background(work: Callable[[], Any]) -> Future:
    """`work()` on a daemon thread: a call that may block forever never keeps the process from exiting."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(work())
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)

    threading.Thread(target=run, name="shipyard-nccl", daemon=True).start()
    return future


class NcclGroup:
    """The trainer's end of one server's weight-transfer group. `post(path, body, timeout)` posts to the server
    (timeout None: the client's) and raises on an answer other than 200 (the engine's `_post`)."""

    def __init__(self, post: Callable[[str, dict | None, float | None], object], workers: int, where: str,
                 collectives: Collectives, timeout: float = 600.0):
        self.post, self.workers, self.where, self.lib, self.timeout = post, workers, where, collectives, timeout
        self.comm: Any = None
        self.broken: str | None = None

    def _watched(self, path: str, body: dict) -> Future:
        """A route vLLM answers only once its workers are done: on a daemon thread, with an HTTP timeout past the
        watch's, so the watch (not the client) decides what a slow answer means."""
        return background(lambda: self.post(path, body, self.timeout + ANSWER_SLACK))

    def open(self) -> None:
        """Join the server's workers in a new group (module docstring, rendezvous)."""
        unique_id = self.lib.unique_id()
        answer = self._watched("/init_weight_transfer_engine", init_payload(unique_id, self.workers))
        joined = background(lambda: self.lib.join(self.workers + 1, unique_id))
        self._settle(answer, joined)
        if joined.done() and joined.exception() is None and answer.done() and answer.exception() is None:
            self.comm = joined.result()
            return
        failed = [f.exception() for f in (answer, joined) if f.done() and f.exception() is not None]
        why = f"{type(failed[0]).__name__}: {failed[0]}" if failed else f"no rendezvous within {self.timeout:g} s"
        raise GroupNotFormed(f"could not join the weight-transfer group of the vLLM server at {self.where} ({why}): "
                             "its log says more; the trainer and the server must reach each other "
                             "(NCCL_SOCKET_IFNAME) and run compatible NCCL versions; or set vllm.transfer = \"disk\"")

    def send(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Broadcast `tensors` (CPU, in the served dtypes: `WeightDir.hold`) to the server's workers (module
        docstring, steps 2–3); the bytes sent."""
        if self.broken:
            raise TransferWedged(self.broken)
        self.post("/start_weight_update", None, None)

        def stream() -> int:
            sent = 0
            for value in tensors.values():
                self.lib.broadcast(self.comm, value)
                sent += value.numel() * value.element_size()
            self.lib.synchronize(self.comm)
            return sent

        answer = self._watched("/update_weights", update_payload(tensors))
        sent = background(stream)
        self._settle(answer, sent)
        if not (sent.done() and sent.exception() is None):  # the trainer's side waits on (or failed): wedged
            cause = next((f.exception() for f in (answer, sent) if f.done() and f.exception() is not None), None)
            why = f"{type(cause).__name__}: {cause}" if cause else f"nothing completed within {self.timeout:g} s"
            self.broken = (f"the NCCL weight transfer to the vLLM server at {self.where} failed half way ({why}); the "
                           "trainer's GPU holds collectives no peer will complete: start the run again (it resumes "
                           "from its last checkpoint), or set vllm.transfer = \"disk\"")
            raise TransferWedged(self.broken)
        if not answer.done() or answer.exception() is not None:  # the trainer's side is whole: the server's failure
            why = answer.exception() if answer.done() else f"no answer within {self.timeout:g} s"
            raise ServerError(f"the vLLM server at {self.where} failed after receiving the weights ({why})")
        self.post("/finish_weight_update", None, None)
        return sent.result()

    def _settle(self, answer: Future, work: Future) -> None:
        """Wait until both are done, or `timeout` passed; once either failed, the other gets `GRACE` seconds more
        (a server's error can arrive just before the trainer's side records that it completed)."""
        deadline = time.monotonic() + self.timeout
        while not (answer.done() and work.done()) and time.monotonic() < deadline:
            if any(f.done() and f.exception() is not None for f in (answer, work)):
                deadline = min(deadline, time.monotonic() + GRACE)
            time.sleep(POLL)

    def close(self) -> None:
        """Shut the server's end down (module docstring: the trainer's end is never destroyed)."""
        if self.comm is not None and not self.broken:
            done = background(lambda: self.post("/shutdown_weight_transfer_engine", None, CLOSE_WAIT))
            with contextlib.suppress(InfraError, RequestRejected, TimeoutError):  # a server gone has none to shut down
                done.result(timeout=CLOSE_WAIT + 1)
        self.comm = None
