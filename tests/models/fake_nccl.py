"""A loopback for NCCL weight pushes (`shipyard.models.nccl`) on the CPU: `LoopbackNccl`, the trainer's end (a
`Collectives`), and `TransferPeer`, the server's workers behind `FakeVLLM`'s weight-transfer routes (`fake.peer`).

They meet in this process by the unique id the trainer mints, and block where NCCL and vLLM block: a rendezvous
returns to neither side before both joined (vLLM answers its init route only then), a broadcast waits while the peer
does not receive (one tensor in flight), a synchronize waits until the peer took every tensor; the fake serializes
its control calls as vLLM's engine core does. Each wait is bounded (`BLOCK`, longer than any test's timeout), so the
daemon threads an abandoned transfer leaves behind end by themselves. Received tensors are checked against the
names, dtypes and shapes `/update_weights` announced, in order, as vLLM's receiver allocates them.
"""

from __future__ import annotations

import base64
import os
import queue
import threading

import torch

BLOCK = 30.0  # seconds a loopback wait lasts before it fails, as NCCL's own timeout would end a real one


class Group:
    def __init__(self):
        self.joined = threading.Event()  # the peer entered the rendezvous
        self.trainer_joined = threading.Event()  # the trainer did: a rendezvous returns to neither side before both
        self.tensors: queue.Queue = queue.Queue(maxsize=1)
        self.sent = self.taken = 0
        self.done = threading.Condition()


GROUPS: dict[bytes, Group] = {}


class LoopbackNccl:
    """`Collectives` whose peer is a `TransferPeer`."""

    def unique_id(self) -> bytes:
        unique_id = os.urandom(128)
        GROUPS[unique_id] = Group()
        return unique_id

    def join(self, world: int, unique_id: bytes) -> Group:
        group = GROUPS[unique_id]
        group.trainer_joined.set()
        if not group.joined.wait(BLOCK):
            raise RuntimeError("loopback: the peer never joined")
        return group

    def broadcast(self, comm: Group, tensor: torch.Tensor) -> None:
        comm.tensors.put(tensor.clone(), timeout=BLOCK)
        with comm.done:
            comm.sent += 1

    def synchronize(self, comm: Group) -> None:
        with comm.done:
            if not comm.done.wait_for(lambda: comm.taken == comm.sent, timeout=BLOCK):
                raise RuntimeError("loopback: the peer did not receive everything")


class TransferPeer:
    """The server's workers: joins a group, receives what `/update_weights` announces."""

    def __init__(self):
        self.group: Group | None = None
        self.received: dict[str, torch.Tensor] = {}

    def init(self, body: dict) -> None:
        info = body["init_info"]
        assert info["rank_offset"] == 1 and info["packed"] is False
        self.group = GROUPS[base64.b64decode(info["nccl_unique_id_b64"], validate=True)]
        self.group.joined.set()
        if not self.group.trainer_joined.wait(BLOCK):  # vLLM answers the route once the group is formed
            raise RuntimeError("loopback: the trainer never joined")

    def receive(self, body: dict, limit: int | None = None) -> None:
        """Receive the announced tensors (only the first `limit`: a worker that dies half way)."""
        info = body["update_info"]
        assert self.group is not None, "update_weights before init_weight_transfer_engine"
        for i, (name, dtype, shape) in enumerate(zip(info["names"], info["dtype_names"], info["shapes"], strict=True)):
            if limit is not None and i >= limit:
                return
            tensor = self.group.tensors.get(timeout=BLOCK)
            assert tensor.dtype == getattr(torch, dtype) and list(tensor.shape) == shape, (name, tensor.dtype, shape)
            self.received[name] = tensor
            with self.group.done:
                self.group.taken += 1
                self.group.done.notify_all()
