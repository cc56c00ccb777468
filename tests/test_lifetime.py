"""Children tied to the process that started them (`shipyard.lifetime`): they outlive the thread that asked for them
and the start of interpreter shutdown, and end with the process. (Killing the parent: tests/rl/test_learning_bench.py
and tests/models/test_vllm_launch.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_tied_child_outlives_the_start_of_interpreter_shutdown():
    """A non-daemon thread still using a child after the main thread returned: the child runs on (an executor's
    worker, joined at the start of shutdown, ended it then with the parent-death signal), and ends with the process."""
    script = textwrap.dedent("""
        import subprocess, sys, threading
        from shipyard.lifetime import die_with_parent, popen

        child = popen(die_with_parent([sys.executable, "-c", "import time; time.sleep(120)"]))
        print(child.pid, flush=True)

        def after_main():
            threading.main_thread().join()  # the main thread has returned: shutdown has begun
            try:
                child.wait(timeout=3)
                print("ended", child.returncode, flush=True)
            except subprocess.TimeoutExpired:
                print("running", flush=True)

        threading.Thread(target=after_main).start()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid, verdict = done.stdout.split("\n")[:2]
    assert verdict == "running", done.stdout + done.stderr
    from servers import alive, wait_for

    assert wait_for(lambda: not alive(int(pid)), 30), "the child outlived its process"
