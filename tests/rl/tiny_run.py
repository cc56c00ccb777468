"""The smallest real `shipyard train` configuration: the tiny random model, one group of 2, 2 turns of 12 tokens — what
the tests that run the command (or a benchmark made of such runs) train with. `{tasks}` is the task set."""

CONFIG = """
[model]
name = "random:tiny"

[run]
tasks = "{tasks}"
held_out_count = 1
steps = 3
seed = 1
eval_samples = 1
checkpoint_every = 1

[rollout]
group_size = 2
groups_per_step = 1
max_staleness = 0
max_in_flight = 1
dynamic_sampling = false

[episode]
grade_timeout = 300.0

[episode.loop]
max_turns = 2
max_new_tokens = 12
seed = 0

[trainer.optim]
name = "adamw"
lr = 1e-3
"""


def run_bench(name: str, *args: str) -> tuple[int, dict, str]:
    """`python -m shipyard.bench.NAME ARGS` as a user runs it: (exit status, its last line's JSON, output's ends)."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", f"shipyard.bench.{name}", *args], capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "COLUMNS": "200"})
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout[-3000:] + proc.stderr[-3000:]
