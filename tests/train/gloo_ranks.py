"""Run a function on N real gloo ranks (spawned processes on 127.0.0.1), for the distributed trainer tests.

Every rank ends with a barrier before `destroy_process_group`, so no rank tears its process group down while a
peer still talks to it (rank 0 also hosts the TCP store). The process group times out after two minutes, so a rank
that dies never leaves the others waiting for the pytest timeout, and `faulthandler` prints every thread's Python
stack if a rank aborts in native code.

Rarely (about once in a hundred runs on the 2-core CI machine) a gloo rank aborts in native code after all of its
work is done ("terminate called without an active exception", a C++ thread torn down at process exit). Such a run
is started again once, with a warning; a rank that raises, hangs or aborts twice still fails the test.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import warnings
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, args: tuple) -> None:
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        fn(rank, world, *args)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(fn, world: int, *args) -> None:
    """Call `fn(rank, world, *args)` on `world` gloo ranks; `fn` must be importable (a module-level function)."""
    for attempt in (1, 2):
        try:
            mp.spawn(_rank_main, args=(world, _free_port(), fn, args), nprocs=world)
            return
        except ProcessExitedException as e:
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
            warnings.warn(f"gloo rank {e.error_index} of {world} aborted in native code; running the ranks again",
                          stacklevel=2)
