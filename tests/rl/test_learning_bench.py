"""`shipyard bench learning`: its figures on hand-made results documents, how it maps the configuration onto `shipyard
eval`, how it cuts a stage at its budget, and — as a user runs it — the arms base, sft and sft+rl with the tiny random
model on the session's task set (one SFT step, one RL step, one held-out task × 2 samples): the pipeline, not the
figures. A second run with the same --out reuses every stage; a stage that started from the wrong model, or from an
export written again since, fails it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
from servers import alive, needs_sandbox, wait_for
from tiny_run import CONFIG, run_bench

from shipyard.bench import learning
from shipyard.bench._stages import run_stage
from shipyard.harness.loop import LoopConfig

TINY = CONFIG + '\n[sft]\nsources = ["gold"]\nepochs = 1\nbatch_size = 4\n'


def loop_settings(**changes) -> dict:
    """An [episode.loop] as the benchmark compares it (`learning.LOOP_SETTINGS`), these fields changed."""
    loop = LoopConfig(**changes)
    return {k: getattr(loop, k) for k in learning.LOOP_SETTINGS}


def _doc(rates: dict[str, float], samples: int = 2, **config) -> dict:
    """A results document with these per-task pass@1 (and rollouts that solved accordingly)."""
    rollouts = [{"task": t, "reward": 1.0 if i < round(r * samples) else 0.0, "sampled_tokens": 100 + 10 * i,
                 "turns": 2 + i} for t, r in rates.items() for i in range(samples)]
    return {"tasks": {t: {"pass_at": {"1": r}} for t, r in rates.items()}, "rollouts": rollouts,
            "config": {"task_ids": list(rates), "samples": samples, "seed": 0, "grade_timeout": 300.0,
                       "loop": {**loop_settings(max_turns=2, max_tokens=4096, max_new_tokens=12), "seed": None},
                       **config}}


def test_pass_figures_pair_arms_by_task():
    docs = {"base": _doc({"a": 0.0, "b": 0.5, "c": 0.0}), "sft": _doc({"a": 0.5, "b": 0.5, "c": 0.0}),
            "sft+rl": _doc({"a": 1.0, "b": 1.0, "c": 0.5})}
    pass_at_1, delta_rl = learning.pass_figures(docs, resamples=500)
    assert pass_at_1["base"]["vs_base"] == {"mean": 0.0, "ci95": [0.0, 0.0], "tasks": 3}
    assert pass_at_1["sft"]["mean"] == pytest.approx(1 / 3) and pass_at_1["sft"]["tasks"] == 3
    assert pass_at_1["sft"]["vs_base"]["mean"] == pytest.approx(1 / 6)
    assert delta_rl["mean"] == pytest.approx(0.5) and delta_rl["ci95"] == [0.5, 0.5]  # +0.5 on every task
    for figure in (*pass_at_1.values(), *(f["vs_base"] for f in pass_at_1.values()), delta_rl):
        lo, hi = figure["ci95"]
        assert lo <= figure["mean"] <= hi
    _, missing = learning.pass_figures({"base": docs["base"], "sft+rl": docs["sft+rl"]}, resamples=10)
    assert missing["mean"] is None and "sft and sft+rl" in missing["note"]
    alone, _ = learning.pass_figures({"sft": docs["sft"]}, resamples=10)
    assert alone["sft"]["vs_base"] is None  # no base arm, nothing to pair with


def test_effort_counts_solved_rollouts():
    e = learning.effort(_doc({"a": 0.5, "b": 0.0}))
    assert (e["solved_rollouts"], e["scored_rollouts"], e["solved_tasks"]) == (1, 4, 1)
    assert (e["tokens_per_solved"], e["turns_per_solved"]) == (100, 2)  # the first sample of a solved it
    assert e["tokens_per_rollout"] == pytest.approx(105) and e["turns_per_rollout"] == pytest.approx(2.5)
    nothing = learning.effort(_doc({"a": 0.0}))
    assert nothing["tokens_per_solved"] is None and nothing["solved_tasks"] == 0


def test_behaviour_reads_what_the_arm_did_from_its_eval_and_is_null_for_an_older_result_file():
    overall = {"fail_to_pass": {"mean": 0.25, "some": 3}, "calls_by_tool": {"read_file": 5, "grep": 1},
               "stop_reasons": {"finished": 2}}
    assert learning.behaviour({"overall": overall}) == {"fail_to_pass_mean": 0.25, "fail_to_pass_some": 3,
                                                        "calls_by_tool": {"read_file": 5, "grep": 1},
                                                        "stop_reasons": {"finished": 2}}
    older = learning.behaviour({"overall": {"stop_reasons": {"finished": 2}}})
    assert older["fail_to_pass_mean"] is None and older["calls_by_tool"] is None
    assert learning._top({"a": 1, "b": 3, "c": 2}, 2) == "b 3, c 2" and learning._top(None, 2) is None


def test_an_evaluation_is_reused_only_when_it_evaluated_the_same_thing():
    doc = _doc({"b": 0.0, "a": 0.0}, model="m")
    expected = {"task_ids": ["a", "b"], "samples": 2, "seed": 0, "grade_timeout": 300.0,
                **loop_settings(max_turns=2, max_tokens=4096, max_new_tokens=12)}
    assert learning.eval_mismatch(doc, expected, "m") is None
    assert learning.eval_mismatch(doc, expected, None) is None  # a results file given with --reuse: any model
    assert "model 'm' (here 'other')" in learning.eval_mismatch(doc, expected, "other")
    assert "samples 2 (here 4)" in learning.eval_mismatch(doc, {**expected, "samples": 4}, "m")
    assert "task_ids" in learning.eval_mismatch(doc, {**expected, "task_ids": ["a"]}, "m")
    assert "max_turns" in learning.eval_mismatch(doc, {**expected, "max_turns": 3}, "m")
    # the context an episode may fill: the 2026-12-07 evaluations ran at shipyard eval's 32768, training at 8192
    assert "max_tokens 4096 (here 8192)" in learning.eval_mismatch(doc, {**expected, "max_tokens": 8192}, "m")
    # every loop field: an evaluation under another failure streak or file overview measured another episode
    assert "max_failed_turns 5 (here 3)" in learning.eval_mismatch(doc, {**expected, "max_failed_turns": 3}, "m")


def test_the_evaluations_take_the_configurations_episode_settings(tmp_path):
    from shipyard.rl.config import load_config

    path = tmp_path / "tiny.toml"
    path.write_text(TINY.format(tasks=tmp_path))
    config = load_config(path, ["--episode.loop.temperature", "0.3", "--episode.loop.tags", "spelled",
                                "--episode.loop.max_tokens", "4096"])
    cmd = learning.eval_command(config, tmp_path, "m", ["x", "y"], 3, 2, tmp_path / "e" / "arm.json")
    flags = dict(itertools.pairwise(cmd))  # each option and what follows it
    assert cmd[3] == "eval" and flags["--model"] == "m"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--task"] == ["x", "y"]
    assert (flags["--samples"], flags["--concurrency"]) == ("3", "2")
    assert flags["--rollouts"] == str(tmp_path / "e" / "arm.rollouts.jsonl")
    # the evaluation runs under the configuration tree itself, written beside its results: every episode field
    assert flags["--config"] == str(tmp_path / "e" / "arm.config.toml")
    assert load_config(flags["--config"], policy="vllm:elsewhere") == config
    settings = learning.eval_settings(config, ["y", "x"], 3)
    assert settings["task_ids"] == ["x", "y"] and settings["temperature"] == 0.3 and settings["seed"] == 1
    assert settings["max_tokens"] == 4096 and settings["wall_time"] == config.episode.loop.wall_time
    assert "seed" not in learning.LOOP_SETTINGS and "overview_entries" in learning.LOOP_SETTINGS


def test_a_stage_whose_episodes_are_not_the_evaluations_is_refused_before_anything_runs(tmp_path):
    """Every arm is evaluated with the episodes it trained with: a stage argument that changes them is refused at the
    start, as one line whose `[episode.loop]` survives the console's markup; a stage run under other episodes is
    not reused."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "bench", "learning", "--", "--config",
                           str(Path(__file__).parents[2] / "configs" / "learning.toml"), "--out", str(tmp_path / "o"),
                           "--rl-args", "--episode.loop.max_tokens 1024"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "300"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--rl-args changes the stage's episodes ([episode.loop] max_tokens 1024 (evaluations: 8192))" in \
        " ".join((proc.stdout + proc.stderr).split())
    assert not (tmp_path / "o").exists()  # refused before the task set was made or anything written
    expected = loop_settings(max_turns=8, max_tokens=8192, max_new_tokens=2048, temperature=1.0,
                             untagged_calls="accept", tags="spelled")
    assert learning.episode_differences(dict(expected), expected) == []
    assert learning.episode_differences({**expected, "max_new_tokens": 384}, expected) == [
        "max_new_tokens 384 (evaluations: 2048)"]


def test_a_stopped_evaluation_is_resumed_only_when_its_journal_is_this_arms(tmp_path):
    from shipyard.rollout.evalrun import settings_path

    expected = {"task_ids": ["x"], "samples": 2, "seed": 0, "grade_timeout": 300.0,
                **loop_settings(max_turns=8, max_tokens=8192, max_new_tokens=384, temperature=1.0,
                                untagged_calls="accept")}
    model = tmp_path / "export"
    model.mkdir()
    (model / "config.json").write_text("{}")
    journal = tmp_path / "arm.rollouts.jsonl"
    journal.write_text('{"a": 1}\n')
    loop = {k: expected[k] for k in learning.LOOP_SETTINGS}

    def written(**changes):
        episode = {"grade_timeout": 300.0, "loop": {**loop, "seed": 0}}
        settings = {"model": str(model), "episode": episode, **changes}
        settings_path(journal).write_text(json.dumps(settings))
        return learning.journal_usable(journal, expected, str(model), str(model))

    os.utime(model / "config.json", (time.time() - 60, time.time() - 60))
    assert written()
    assert not written(model="other")
    assert not written(episode={"grade_timeout": 300.0, "loop": {**loop, "temperature": 0.7}})
    assert not written(episode={"grade_timeout": 60.0, "loop": loop})
    written(model=f"vllm:{model}")
    assert learning.journal_usable(journal, expected, str(model), f"vllm:{model}")  # sampled by a vLLM server
    assert not learning.journal_usable(journal, expected, str(model), str(model))  # by another engine: not resumed
    (model / "config.json").write_text("{}")  # exported again after the journal's last line
    os.utime(model / "config.json", (time.time() + 60, time.time() + 60))
    assert not written()
    settings_path(journal).unlink()
    assert not learning.journal_usable(journal, expected, str(model), str(model))


@pytest.mark.parametrize("argv, message", [
    (["--arms", "base,reward"], "name arms among"),
    (["--reuse", "sft"], "name arms among"),
    (["--reuse", "sft=/nonexistent/run"], "no such run directory"),
    (["--samples", "0"], "must be positive"),
    (["--minutes", "4", "--eval-reserve", "4"], "--eval-reserve"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        learning.parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_reusing_a_run_directory_for_the_base_arm_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        learning.parse(["--reuse", f"base={tmp_path}"])
    assert "no training stage" in capsys.readouterr().err
    args, overrides = learning.parse(["--reuse", f"sft={tmp_path}", "--run.steps", "3", "--arms", "sft"])
    assert args.reuse_runs == {"sft": str(tmp_path)} and overrides == ["--run.steps", "3"]


def test_the_sampler_is_vllm_where_it_is_installed_unless_told(tmp_path):
    from shipyard.errors import UsageError
    from shipyard.rl.config import load_config

    python = tmp_path / "venv" / "python"
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "m"\n[vllm]\npython = "venv/python"\n')
    config = load_config(path)
    assert learning.sampler("auto", config) == "local" and learning.sampler("local", config) == "local"
    with pytest.raises(UsageError, match="install-vllm"):
        learning.sampler("vllm", config)
    python.parent.mkdir()
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert learning.sampler("auto", config) == "vllm" and learning.sampler("local", config) == "local"


def test_a_stage_past_its_budget_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"]
    record = run_stage("stuck", cmd, tmp_path / "stuck.log", 0.005, lambda: 0, None)
    assert record["cut_at_budget"] is True and record["returncode"] is None
    child = int(pid_file.read_text())
    for _ in range(100):  # the group got SIGTERM: wait for the grandchild to be gone (reaped by init)
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the stage's child {child} outlived the stage")
    done = run_stage("quick", ["true"], tmp_path / "quick.log", None, lambda: 0, None)
    assert done["returncode"] == 0 and not done["cut_at_budget"]


@pytest.mark.parametrize("kill", [signal.SIGTERM, signal.SIGKILL])
def test_a_stage_ends_with_a_benchmark_that_is_killed(tmp_path, kill):
    """SIGTERM (which skips run_stage's `finally`) or SIGKILL of the benchmark: the kernel ends its stage
    (`shipyard.lifetime.die_with_parent`). Before, a `kill` of `bench learning` left its evaluation running."""
    pid_file = tmp_path / "stage.pid"
    bench = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from shipyard.bench._stages import run_stage
        stage = "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
        run_stage("long", [sys.executable, "-c", stage], Path({str(tmp_path / "long.log")!r}), None, lambda: 0, None)
        """)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip(), 60), "the stage did not start"
        stage = int(pid_file.read_text())
        bench.send_signal(kill)
        bench.wait(timeout=60)
        assert wait_for(lambda: not alive(stage), 30), f"the stage {stage} outlived its benchmark"
    finally:
        bench.kill()
        with contextlib.suppress(ProcessLookupError, ValueError, NameError):
            os.kill(stage, signal.SIGKILL)


def test_a_child_tied_to_a_parent_already_gone_does_not_run(tmp_path):
    """The parent died between the fork and the prctl (the kernel would then never signal): the boot sees it is no
    longer the parent's child and exits instead of running the command."""
    from shipyard.lifetime import die_with_parent

    marker = tmp_path / "ran"
    cmd = die_with_parent(["touch", str(marker)])
    cmd[cmd.index(str(os.getpid()))] = "1"  # as if started by a process that is not its parent
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "is gone" in result.stderr and not marker.exists()
    assert subprocess.run(die_with_parent(["touch", str(marker)]), timeout=60).returncode == 0 and marker.exists()


def _planner(tmp_path: Path, minutes: float, spent_minutes: float | None, budgets: dict | None = None):
    """A `Bench` as far as `Bench.plan` sees one: --minutes (eval reserve 3), stages.json, budgets.json."""
    from types import SimpleNamespace

    tmp_path.mkdir(exist_ok=True)
    if budgets is not None:
        (tmp_path / "budgets.json").write_text(json.dumps(budgets))
    seconds = {} if spent_minutes is None else {"sft": spent_minutes * 60}
    bench = SimpleNamespace(args=SimpleNamespace(minutes=minutes, eval_reserve=3.0, reuse_runs={}),
                            budgets_path=tmp_path / "budgets.json", open_path=tmp_path / "running.json",
                            seconds=seconds)
    bench.spent = lambda stage, state: learning.Bench.spent(bench, stage, state)
    return bench


def test_a_stages_budget_counts_its_earlier_runs_and_a_step_must_fit(tmp_path):
    run = tmp_path / "sft"
    plan = learning.Bench.plan
    stopped = {"status": "finished", "export": True, "stopped": "max_minutes", "max_minutes": 117.0,
               "longest_step": 807.0, "updated": None, "recorded_seconds": None}
    assert plan(_planner(tmp_path, 120, None), "sft", run, {}) == ("run", 117.0, None)  # a new stage: all of it
    run.mkdir()
    (run / "run.json").write_text("{}")
    assert plan(_planner(tmp_path, 120, 119.0, {"sft": 117.0}), "sft", run, stopped) == ("reuse", 0.0, None)
    assert plan(_planner(tmp_path, 120, 119.0), "sft", run, {**stopped, "stopped": None})[0] == "reuse"  # finished
    # a larger budget continues it for what is left; before budgets.json, the run's own max_minutes is its budget
    for budgets in ({"sft": 117.0}, None):
        action, minutes, _ = plan(_planner(tmp_path / str(budgets is None), 360, 119.0, budgets), "sft", run, stopped)
        assert action == "run" and minutes == pytest.approx(357 - 119)
    # too little more to hold its longest step (13.5 min) and start-up: reused as it is, and said so
    action, _, note = plan(_planner(tmp_path, 130, 119.0, {"sft": 117.0}), "sft", run, stopped)
    assert action == "reuse" and "hold no step" in note
    action, _, note = plan(_planner(tmp_path, 60, 119.0, {"sft": 117.0}), "sft", run, stopped)
    assert action == "reuse" and "more than this run's 57" in note  # a smaller budget: reused, and said so
    # killed (or failed): resumed with what is left, refused once the budget is spent
    killed = {**stopped, "status": "running", "stopped": None}
    assert plan(_planner(tmp_path, 120, 50.0, {"sft": 117.0}), "sft", run, killed) == ("run", 67.0, None)
    action, _, note = plan(_planner(tmp_path, 120, 119.0, {"sft": 117.0}), "sft", run, killed)
    assert action == "spent" and "raise --minutes" in note
    # a run that died with the benchmark (a session ended) counts up to its last step: from the benchmark's mark,
    # or, for a run begun before marks were kept, from its own record; never its whole budget
    died = {**killed, "updated": 1000.0 + 40 * 60, "recorded_seconds": 39 * 60.0}
    bench = _planner(tmp_path / "died", 360, None, {"sft": 357.0})
    assert plan(bench, "sft", run, died) == ("run", 357.0 - 39, None)
    (tmp_path / "died" / "running.json").write_text(json.dumps({"sft": 1000.0}))
    assert plan(bench, "sft", run, died) == ("run", 357.0 - 40, None)
    bench.seconds = {"sft": 100 * 60.0}  # an earlier run here took 100 minutes, then a resume died after 40 more
    assert plan(bench, "sft", run, died) == ("run", 357.0 - 140, None)


def _bench(config: Path, out: Path, *extra: str) -> tuple[int, dict, str]:
    return run_bench("learning", "--config", str(config), "--run.steps", "1", "--minutes", "10", "--bootstrap", "200",
                     "--engine", "local", "--out", str(out), *extra)


@needs_sandbox
def test_the_bench_trains_and_evaluates_base_sft_and_sft_rl(taskset, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(tasks=taskset[0]))
    out = tmp_path / "out"
    rc, result, log = _bench(config, out)
    assert rc == 0, log
    arms = ["base", "sft", "sft+rl"]
    assert result["arms"] == arms and result["failures"] == [] and len(result["held_out"]) == 1
    for arm in arms:
        figure = result["pass_at_1"][arm]
        assert set(figure) >= {"mean", "ci95", "vs_base"} and figure["tasks"] == 1
        for f in (figure, figure["vs_base"]):
            lo, hi = f["ci95"]
            assert -1.0 <= lo <= f["mean"] <= hi <= 1.0
        assert figure["ci95"][0] >= 0.0  # a rate
        assert result["effort"][arm]["scored_rollouts"] == 2  # 1 task × 2 samples, every arm
        assert set(result["effort"][arm]) >= {"tokens_per_solved", "turns_per_solved"}
        assert 0.0 <= result["behaviour"][arm]["fail_to_pass_mean"] <= 1.0
        assert sum(result["behaviour"][arm]["stop_reasons"].values()) == 2
    assert result["pass_at_1"]["base"]["vs_base"] == {"mean": 0.0, "ci95": [0.0, 0.0], "tasks": 1}
    assert set(result["delta_rl"]) >= {"mean", "ci95"} and result["delta_rl"]["tasks"] == 1
    assert set(result["stages"]) == {"sft", "sft+rl", "eval base", "eval sft", "eval sft+rl"}
    assert all(s > 0 for s in result["stages"].values())
    assert Path(result["plot"]).stat().st_size > 10_000
    # the RL stage started from the SFT export; every stage held out the benchmark's tasks; every arm was
    # evaluated on them with the same seed and samples
    saved = {s: tomllib.loads((out / s / "config.toml").read_text()) for s in ("sft", "sft+rl")}
    assert saved["sft+rl"]["model"]["name"] == str((out / "sft" / "export").resolve())
    assert saved["sft+rl"]["run"]["evaluate"] is False and not list((out / "sft+rl" / "eval").iterdir())
    assert all(sorted(c["run"]["held_out"]) == result["held_out"] for c in saved.values())
    evals = {arm: json.loads((out / "eval" / f"{arm}.json").read_text())["config"] for arm in arms}
    assert {(tuple(e["task_ids"]), e["samples"], e["seed"]) for e in evals.values()} == {
        (tuple(result["held_out"]), 2, 1)}
    assert [e["model"] for e in evals.values()] == ["random:tiny", str((out / "sft" / "export").resolve()),
                                                     str((out / "sft+rl" / "export").resolve())]

    # the same command again: every stage and evaluation reused, the same figures
    rc, again, log = _bench(config, out)
    assert rc == 0, log
    assert all("reused" in r for r in again["runs"].values()) and again["pass_at_1"] == result["pass_at_1"]
    assert again["stages"] == pytest.approx(result["stages"])

    # an sft+rl stage that did not start from the SFT export is not this benchmark's: the arm fails, exit 1
    rc, wrong, log = _bench(config, tmp_path / "out2", "--reuse", f"sft={out / 'sft'}", "--reuse",
                            f"sft+rl={out / 'sft'}", "--reuse", f"base={out / 'eval' / 'base.json'}", "--reuse",
                            f"sft={out / 'eval' / 'sft.json'}")
    assert rc == 1, log
    assert any(f.startswith("sft+rl: it started from random:tiny") for f in wrong["failures"]), wrong["failures"]
    assert "sft+rl" not in wrong["pass_at_1"] and wrong["delta_rl"]["mean"] is None

    # the SFT stage exported again after the RL stage started from it (trained again): the RL stage is stale
    export = out / "sft" / "export" / "config.json"
    later = (out / "sft+rl" / "config.toml").stat().st_mtime + 10
    os.utime(export, (later, later))
    rc, stale, log = _bench(config, out, "--arms", "sft+rl")
    assert rc == 1, log
    assert any("exported again after this run started from it" in f for f in stale["failures"]), stale["failures"]


@needs_sandbox
def test_a_stage_stopped_at_its_budget_is_continued_only_when_the_budget_grows(taskset, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(tasks=taskset[0]))
    out = tmp_path / "out"
    # two SFT steps (2 epochs of one batch); 6 s for steps, so it stops itself after the first
    small = ("--arms", "sft", "--sft-args", "--sft.epochs 2", "--minutes", "3", "--eval-reserve", "2.9")
    rc, first, log = _bench(config, out, *small)
    assert rc == 0, log
    assert first["runs"]["sft"]["stopped"] == "max_minutes" and first["runs"]["sft"]["steps"] == 1, first["runs"]

    rc, again, log = _bench(config, out, *small)  # the same budget: reused as it is
    assert rc == 0, log
    assert "reused" in again["runs"]["sft"] and again["runs"]["sft"]["steps"] == 1
    assert "reused" in again["runs"]["eval sft"]

    larger = (*small[:-4], "--minutes", "20", "--eval-reserve", "2.9")  # 17.1 minutes in all, less what it took
    rc, more, log = _bench(config, out, *larger)
    assert rc == 0, log
    sft = more["runs"]["sft"]
    assert "reused" not in sft and sft["steps"] == 2 and sft["stopped"] is None, sft
    assert "--run.resume true" in sft["command"] and "reused" not in more["runs"]["eval sft"]
    assert more["stages"]["sft"] > first["stages"]["sft"]  # the continuation adds to what the stage took
