"""Another process's crash recovery must not remove a sandbox or a snapshot that is still being made (its owner
record not yet written, or written but still empty): the grader reported such a sandbox as infra_error."""

import os
import subprocess
import sys
import time
import uuid

from servers import needs_sandbox

from shipyard.sandbox.host import host

pytestmark = needs_sandbox

RECOVER = ("from shipyard.sandbox.host import host; from shipyard.sandbox.layout import recover_stale; "
           "from shipyard.sandbox.snapshot import recover_snapshots; h = host(); "
           "print(recover_stale(h), recover_snapshots(h.state_dir / 'snapshots'))")


def test_recovery_spares_what_is_still_being_made():
    """Old code: a fresh sandbox dir without its owner file yet, and a snapshot whose owner file is still empty,
    were removed by the first sandbox any other shipyard process started: that sandbox then failed to start
    (FileNotFoundError), and the grader said infra_error, reward null. Ones left long ago are still recovered."""
    h = host()
    made, old = h.state_dir / "sandboxes" / uuid.uuid4().hex[:12], h.state_dir / "sandboxes" / uuid.uuid4().hex[:12]
    owner = h.state_dir / "snapshots" / f".{uuid.uuid4().hex[:12]}.owner"
    for d in (made, old):
        (d / "etc").mkdir(parents=True)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    owner.write_text("")
    try:
        subprocess.run([sys.executable, "-c", RECOVER], check=True, capture_output=True, timeout=120)
        assert made.is_dir() and owner.exists()
        assert not old.exists()
    finally:
        for p in (made, old):
            subprocess.run(["rm", "-rf", "--", str(p)], check=False)
        owner.unlink(missing_ok=True)
