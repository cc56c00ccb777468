"""Child processes that end with the process that started them.

shipyard starts long-lived children from a process that can itself be killed outright: vLLM servers (7 GB each) from a
run, trainer ranks from rank 0, a benchmark's stages (a whole `shipyard eval` with its own server and sandboxes) from
`shipyard bench`. A SIGKILL, the OOM killer or a plain SIGTERM (which ends a Python process without running its
`finally` blocks) gives the parent no chance to stop them, and before this they ran on: a killed `bench learning` left
its evaluation sampling for an hour.

The kernel can do it instead. `PR_SET_PDEATHSIG` (prctl(2)) asks for a signal when the *thread* that forked the
child ends; it is kept across `execve` (except into a set-uid program). `die_with_parent` wraps a command in a
one-line Python boot that sets it, then checks that its parent is still the process that meant to start it (the
parent may have died between the fork and the prctl: the signal is then never sent), then `exec`s the command, so
the child keeps the boot's pid and the caller's `Popen` handle is the command's own. The boot's interpreter is
isolated (`-I -S`): it imports only the standard library and reads no environment variable meant for the command.

Whoever starts such a child must do it from a thread that lives as long as the child should (a run's main thread).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

_BOOT = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, int(sys.argv[1])); "  # 1: PR_SET_PDEATHSIG
         "os.getppid() == int(sys.argv[2]) or sys.exit('shipyard: the process that started this one is gone'); "
         "os.execvp(sys.argv[3], sys.argv[3:])")


def die_with_parent(argv: Sequence[str], on_parent_death: signal.Signals = signal.SIGTERM) -> list[str]:
    """`argv` as a command that receives `on_parent_death` when the calling thread ends (module docstring). SIGTERM
    lets the child clean up (a server stops its workers); SIGKILL for a child with nothing to clean up."""
    return [sys.executable, "-I", "-S", "-c", _BOOT, str(int(on_parent_death)), str(os.getpid()), *map(str, argv)]
