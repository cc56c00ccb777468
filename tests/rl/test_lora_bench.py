"""`shipyard bench lora`: its figures on hand-made curves (late-step means, differences paired by step, the verdict),
and — as a user runs it — the three arms with the tiny random model on the session's task set, 2 RL steps each: every
arm is the same `shipyard train` but for its trainer, and a second run with the same --out reuses them."""

from __future__ import annotations

import tomllib

import pytest
from servers import needs_sandbox
from tiny_run import CONFIG, run_bench

from shipyard.bench import lora


def _curve(reward: list[float]) -> dict[str, list]:
    return {"reward": reward, "grounded": [r / 2 for r in reward], "seconds": [10.0] * len(reward),
            "peak_rss_mb": [100.0 + i for i in range(len(reward))]}


def test_late_steps_are_compared_paired_by_step():
    runs = {"full": _curve([0.0, 0.1, 0.4, 0.5]), "lora-r1": _curve([0.0, 0.0, 0.1, 0.1]),
            "lora-r1-x10": _curve([0.0, 0.2, 0.6, 0.7])}
    figures = lora.compare(runs, resamples=500)
    assert figures["full"]["late_steps"] == [3, 4] and "reward_vs_full" not in figures["full"]
    assert figures["full"]["reward"] == {"mean": pytest.approx(0.45), "ci95": [0.4, 0.5], "steps": 2}
    assert figures["lora-r1"]["reward_vs_full"]["mean"] == pytest.approx(-0.35)  # (0.1-0.4 + 0.1-0.5) / 2
    assert figures["lora-r1"]["reward_vs_full"]["ci95"] == [pytest.approx(-0.4), pytest.approx(-0.3)]
    assert figures["lora-r1-x10"]["grounded_vs_full"]["mean"] == pytest.approx(0.1)  # halves of +0.2, +0.2
    assert figures["full"]["seconds_per_step"] == 10.0 and figures["full"]["peak_rss_mb"] == 103.0
    assert lora.verdict(figures, 1, 10).startswith("not measured: 2 late step(s)")  # too few for any verdict
    # arms of different lengths share one window: the steps every arm made
    shorter = lora.compare({**runs, "full": _curve([0.0, 0.1, 0.4, 0.5, 0.5, 0.5])}, resamples=100)
    assert shorter["full"]["late_steps"] == [3, 4] and shorter["full"]["reward"]["mean"] == pytest.approx(0.45)


def test_the_verdict_says_where_each_interval_lies():
    full = [0.1 * i for i in range(8)]

    def said(scaled: list[float], plain: list[float] | None) -> str:
        runs = {"full": _curve(full), "lora-r1-x10": _curve(scaled), **({"lora-r1": _curve(plain)} if plain else {})}
        return lora.verdict(lora.compare(runs, resamples=500), 1, 10)

    below, same = [v - 0.3 for v in full], [v + (0.05 if i % 2 else -0.05) for i, v in enumerate(full)]
    above = [v + 0.2 for v in full]
    assert said(same, below).startswith("at 10x, LoRA rank 1 was not distinguishable from full fine-tuning")
    assert "; at 1x it was below full fine-tuning" in said(same, below)
    assert said(above, above).startswith("at 10x, LoRA rank 1 was above") and "at 1x it was above" in said(above, above)
    assert said(below, None).startswith("at 10x, LoRA rank 1 was below") and "the 1x arm did not finish" in \
        said(below, None)
    assert said(same, below).endswith("in this one run")
    assert lora.verdict(lora.compare({"full": _curve(full)}, resamples=10), 1, 10).startswith("not measured")


def test_arms_differ_only_in_the_trainer():
    plan = lora.arms(3e-6, 1, 10)
    assert list(plan) == ["full", "lora-r1", "lora-r1-x10"]
    assert plan["full"] == ["--trainer.lora.enabled", "false", "--trainer.optim.lr", "3e-06"]
    assert plan["lora-r1-x10"][-1] == repr(3e-5) and "--trainer.lora.enabled" in plan["lora-r1-x10"]


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--rank", "0"], ["--scale", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        lora.parse(argv)
    assert e.value.code == 2 and "--steps must be at least 2" in capsys.readouterr().err


def _bench(config, out, *extra: str) -> tuple[int, dict, str]:
    return run_bench("lora", "--config", str(config), "--steps", "2", "--minutes", "10", "--bootstrap", "100", "--out",
                     str(out), *extra)


@needs_sandbox
def test_the_bench_trains_every_arm_the_same_way_but_for_the_trainer(taskset, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=taskset[0]))
    out = tmp_path / "out"
    rc, result, log = _bench(config, out)
    assert rc == 0, log
    assert list(result["arms"]) == ["full", "lora-r1", "lora-r1-x10"] and result["failures"] == []
    for arm, figure in result["arms"].items():
        assert figure["steps"] == 2 and len(result["curves"][arm]["reward"]) == 2
        assert figure["reward"]["mean"] is not None and figure["peak_rss_mb"] > 0
    assert result["arms"]["lora-r1"]["reward_vs_full"]["steps"] == 1  # the late half of 2 steps
    assert result["verdict"].startswith("not measured: 1 late step(s)")
    saved = {arm: tomllib.loads((out / arm / "config.toml").read_text()) for arm in result["arms"]}
    assert saved["full"]["trainer"]["lora"]["enabled"] is False
    assert saved["lora-r1"]["trainer"]["lora"]["enabled"] and saved["lora-r1"]["trainer"]["lora"]["rank"] == 1
    assert saved["lora-r1"]["trainer"]["optim"]["lr"] == saved["full"]["trainer"]["optim"]["lr"] == 1e-3
    assert saved["lora-r1-x10"]["trainer"]["optim"]["lr"] == pytest.approx(1e-2)
    trainer_free = [{k: v for k, v in c.items() if k not in ("trainer", "run")} for c in saved.values()]
    assert all(c == trainer_free[0] for c in trainer_free)  # only the trainer (and each run's own dir) differs
    assert all(c["run"]["evaluate"] is False and c["run"]["seed"] == 1 for c in saved.values())
    assert (out / "lora.png").stat().st_size > 10_000

    rc, again, log = _bench(config, out)  # the same command: every arm reused, the same figures
    assert rc == 0, log
    assert all("reused" in r for r in again["runs"].values()) and again["arms"] == result["arms"]
    rc, other, log = _bench(config, out, "--trainer.optim.lr", "1e-4")  # another command: refused, not reused
    assert rc == 1, log
    assert len(other["failures"]) == 3 and all("trained by another command" in f for f in other["failures"])
