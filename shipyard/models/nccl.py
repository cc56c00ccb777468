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

1. `prepare`: the tensors are checked against the served checkpoint (`weightdir.matched`: names, shapes; values
   finite after the cast to the served dtype) before any server is touched;
2. `/start_weight_update` (vLLM begins its layerwise reload), then `/update_weights` with the tensors' names, dtypes
   and shapes, posted on a thread (the workers answer once they have received everything) while the trainer
   broadcasts each tensor in that order from its GPU on a stream of its own — one by one (`packed` false: nothing
   about vLLM's packing has to agree);
3. the broadcasts are waited for by polling a CUDA event while watching the route's answer, within `timeout`; then
   `/finish_weight_update`.

A transfer that fails half way (the server answered an error, or the timeout passed) leaves NCCL kernels of the
trainer's process waiting for peers that will not come, and PyTorch offers no way to abort them. So it raises
`TransferWedged`, which ends the run saying what to do — start it again: it resumes from its last checkpoint —
rather than an `InfraError` the loop would retry beside a stuck stream.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shipyard.errors import UserError
from shipyard.models.errors import InfraError
from shipyard.models.openai import RequestRejected
from shipyard.models.weightdir import TensorSpec, finite, matched

POLL = 0.01  # seconds between checks of a transfer's progress
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # vLLM: getattr(torch)


class TransferWedged(UserError, RuntimeError):
    """An NCCL transfer that failed half way: the trainer's GPU holds kernels waiting for peers (module docstring)."""


def init_payload(unique_id: bytes, workers: int) -> dict:
    """The body of `/init_weight_transfer_engine` for a server of `workers` GPUs joining the trainer's rank 0
    (vLLM's `NCCLWeightTransferInitInfo`, unique-id mode)."""
    return {"init_info": {"rank_offset": 1, "world_size": workers + 1, "packed": False,
                          "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii")}}


def update_payload(plan: list[tuple[str, torch.Tensor, TensorSpec]]) -> dict:
    """The body of `/update_weights`: what the workers receive, in the order it is broadcast (vLLM's
    `NCCLWeightTransferUpdateInfo`)."""
    return {"update_info": {"names": [name for name, _, _ in plan],
                            "dtype_names": [DTYPE_NAMES[want.dtype] for _, _, want in plan],
                            "shapes": [list(want.shape) for _, _, want in plan]}}


def prepare(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec]
            ) -> list[tuple[str, torch.Tensor, TensorSpec]]:
    """What a push sends, checked before any server is touched (module docstring, step 1); `PushRejected` otherwise."""
    plan = matched(tensors, spec)
    for name, t, want in plan:
        if want.dtype not in DTYPE_NAMES:
            raise UserError(f"the served checkpoint stores {name} as {want.dtype}: an NCCL push sends bfloat16, "
                            "float16 or float32; use vllm.transfer = \"disk\"")
        finite(name, t.detach().to(want.dtype))
    return plan


class NcclGroup:
    """The trainer's end of one server's weight-transfer group. `post(path, body)` posts to the server and raises
    on an answer other than 200 (the engine's `_post`)."""

    def __init__(self, post: Callable[[str, dict | None], object], workers: int, where: str, timeout: float = 600.0,
                 device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise UserError(f"vllm.transfer = \"nccl\" broadcasts the weights from the trainer's GPU, and this process "
                            f"sees none (for {where}): run the trainer on GPUs, or set vllm.transfer = \"disk\"")
        self.post, self.workers, self.where, self.timeout = post, workers, where, timeout
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.comm = None
        self.stream: torch.cuda.Stream | None = None
        self.broken: str | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shipyard-nccl")

    def open(self) -> None:
        """Join the server's workers in a new group (module docstring, rendezvous)."""
        unique_id = torch.cuda.nccl.unique_id()
        self.stream = torch.cuda.Stream(self.device)
        answer = self._thread.submit(self.post, "/init_weight_transfer_engine", init_payload(unique_id, self.workers))
        made: dict = {}

        def init() -> None:  # blocks until every rank joined: on a daemon thread, so a server that never does is a
            with torch.cuda.device(self.device):  # timeout here, not a process that cannot exit
                made["comm"] = torch.cuda.nccl.init_rank(self.workers + 1, unique_id, 0)

        joining = threading.Thread(target=init, name="shipyard-nccl-init", daemon=True)
        joining.start()
        deadline = time.monotonic() + self.timeout
        while joining.is_alive() and time.monotonic() < deadline:
            if answer.done() and answer.exception() is not None:
                break
            joining.join(POLL)
        if "comm" not in made:
            self._wedged("joining its weight-transfer group", answer, "the group was not formed")
        self.comm = made["comm"]
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            warm = torch.zeros(1, device=self.device)  # vLLM's warm-up: one float32, summed
            torch.cuda.nccl.all_reduce([warm], streams=[self.stream], comms=[self.comm])
        self._wait(answer, "joining its weight-transfer group")

    def send(self, plan: list[tuple[str, torch.Tensor, TensorSpec]]) -> int:
        """Broadcast `plan` (from `prepare`) to the server's workers (module docstring, steps 2–3); the bytes sent."""
        if self.broken:
            raise TransferWedged(self.broken)
        self.post("/start_weight_update", None)
        answer = self._thread.submit(self.post, "/update_weights", update_payload(plan))
        sent = 0
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for _, t, want in plan:
                if answer.done():  # the route failed before its workers joined: no broadcast will be received
                    break
                # allocated on the transfer's stream: freed in its order once broadcast
                value = t.detach().to(self.device, want.dtype, non_blocking=False).contiguous()
                torch.cuda.nccl.broadcast([value], root=0, streams=[self.stream], comms=[self.comm])
                sent += value.numel() * value.element_size()
                del value
        self._wait(answer, "receiving the weights")
        self.post("/finish_weight_update", None)
        return sent

    def _wait(self, answer: Future, doing: str) -> None:
        """Until the server answered and the trainer's collectives on the transfer stream are done, within
        `timeout`; `TransferWedged` when either fails (module docstring)."""
        done = torch.cuda.Event()
        done.record(self.stream)
        deadline = time.monotonic() + self.timeout
        while not (answer.done() and done.query()):
            if (answer.done() and answer.exception() is not None) or time.monotonic() > deadline:
                break
            time.sleep(POLL)
        else:
            return
        self._wedged(doing, answer, "the trainer's collectives did not complete")

    def _wedged(self, doing: str, answer: Future, otherwise: str) -> None:
        limit = f"within {self.timeout:g} s"
        why = (f"it answered {answer.exception()}" if answer.done() and answer.exception() is not None else
               f"no answer {limit}" if not answer.done() else f"{otherwise} {limit}")
        self.broken = (f"the NCCL weight transfer to the vLLM server at {self.where} failed while {doing} ({why}); the "
                       "trainer's GPU holds collectives no peer will complete: start the run again (it resumes from "
                       "its last checkpoint), or set vllm.transfer = \"disk\"")
        raise TransferWedged(self.broken)

    def close(self) -> None:
        """Leave the group (the server's end is shut down when it answers; a dead server has none)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self.comm is not None and not self.broken:
            with contextlib.suppress(InfraError, RequestRejected):  # a server gone has no group to shut down
                self.post("/shutdown_weight_transfer_engine", None)
        self.comm = None
