"""The grader: a patch's reward, from a fresh sandbox over the task's snapshot, through layers no patch can steer.

RL optimises what the reward measures, so the reward is a claim about the code the patch wrote, not about what the
test run could be talked into saying. In order:

1. **Inputs.** The task is checked against its schema (`taskset.check_task`: FAIL_TO_PASS not empty, every path
   relative and inside the task) and each canonical test file and the gold patch are read without following a
   link (`taskset.read_canonical`, `read_gold`: a link, directory or FIFO as `gold.patch` is a malformed task; a
   missing one is the empty patch, as synthesis grades before writing it). A bad task raises `TaskFormatError`;
   it is never graded. Nothing else raises: every patch gets a verdict.
2. **Static gate, on the host, before any sandbox.** `patchparse.parse_patch` reads the patch the way `git apply`
   does (a patch over `tree_diff`'s 8 MiB bound, counted in bytes, or one no file can hold, is refused unread); a
   patch without file sections (empty, or only `tree_diff`'s leading note) is the empty patch. `change_problems`
   refuses every path a solution does not touch (tests and test configuration, dot paths, start-up hooks, compiled
   modules, new files outside the project's packages, links, names the file system would refuse) and `steering`
   refuses added code that reaches for pytest, import hooks or builtins, a caller's locals, hard exits, a
   function's `__code__` or the test files unless the gold patch does too → `patch_rejected`. Every parser and
   pattern on this path is linear in the patch (tests/tasks/test_patchscan.py times their worst cases).
3. **Apply, in a fresh sandbox.** `git apply --numstat --summary -z` must list exactly the files the parser found
   and no link or submodule mode (two parsers that disagree → `patch_rejected`); `git apply` failing →
   `patch_failed`; afterwards every path the patch names must be a regular file or absent (`lstat`).
4. **Restore.** Every canonical test file and configuration is written back (whatever the path holds — a link, a
   directory — is removed first), and each module that holds a scored test gets this run's canaries appended: a
   test that must fail and one that must pass, under random names (`suite.Canary`).
5. **Run** (`suite.run_suite`, exactly as synthesis ran it): an isolated interpreter (the working directory is not
   on `sys.path`, no `PYTHON*`/`PYTEST*` variables, no user site), the configuration chosen among the task's
   canonical root configs by pytest's own precedence and passed with `-c`/`--rootdir`, a run directory with a random
   name, the launcher's integrity check of pytest's machinery and its seal over the report.
6. **Score.** Every FAIL_TO_PASS and PASS_TO_PASS test must be reported and pass → reward 1, else 0. Then the
   evidence of tampering, which scores 0 whatever the tests said, status `tampered`: a must-fail canary passed
   (outcomes were forced), canaries missing or wrong in a run that would have scored 1, a report that does not
   match the launcher's seal, or changes to pytest's machinery during the run.
7. **Differential check** (`shipyard.tasks.differential`), when the tests said 1 and the task has cases: the
   candidate is called in the same sandbox on inputs recorded from the tests and perturbed, and compared with the
   original's results kept beside the task. One that differs → `differential_failed`, 0: code that fits the tests
   (a lookup table of their inputs) is not the feature. A probe that left no result goes to the control run below.
8. **Failures are the patch's unless proven otherwise.** A suite past its timeout → `timeout`, 0. No readable
   report, or a sandbox session that died once the patch was in it → a **control run**: a fresh sandbox over the
   same pristine snapshot runs a module of canaries the same way. If it works, the infrastructure works, and the
   failure was the patch's doing → `no_report` or `crashed`, reward 0. Only if the control fails too →
   `infra_error`, reward null (training skips it). A sandbox that fails to start before the patch reached it is
   `infra_error` directly. The control run costs a second or two, and only on failure.

`detail` is composed here, at most `DETAIL_CHARS` printable ASCII characters, never the sandbox's or pytest's
output (a `git apply` error keeps its first line, sanitised). `evidence` lists what the gate or the tamper checks
found, each item sanitised and bounded. `collection_errors` holds only the task's own test modules: a report's
other names are text the sandbox chose (review A5), counted in `evidence`, never copied.

What a patch could still do: attack the in-process layers from code the static gate did not recognise (it is a
screen of patterns, and obfuscated code passes it): find the launcher's records and rewrite them, or single out the
canaries (by reading the test files the run uses) and force every other outcome. The canaries and the integrity
check each catch the generic form of such an attack; a targeted one has to defeat both, from code that imports none
of the machinery by name. The monitors (`shipyard.tasks.monitors`) flag the attempt either way.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from shipyard.harness.confined import PathError
from shipyard.harness.diff import MAX_DIFF_BYTES
from shipyard.harness.workspace import MAX_DIR_ENTRIES
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import snapshot_of
from shipyard.tasks import differential
from shipyard.tasks.differential import Case
from shipyard.tasks.patchparse import FileChange, parse_patch
from shipyard.tasks.patchscan import change_problems, is_test_config, steering
from shipyard.tasks.suite import Canary, NoReport, SuiteRun, canary_problems, printable, run_suite, top_level_configs
from shipyard.tasks.taskset import Task, check_task, read_canonical, read_capped

__all__ = ["DETAIL_CHARS", "Refused", "Verdict", "apply_patch", "control_run", "gate", "grade", "is_test_config",
           "not_regular", "patch_paths", "read_gold"]

DETAIL_CHARS = 300
EVIDENCE = 20  # items of evidence kept, each at most 160 characters
MAX_GOLD = 8 << 20
CONTROL_TIMEOUT = 300.0
LINK_MODES = {b"120000", b"160000"}


@dataclass
class Verdict:
    task: str
    status: str  # graded | patch_rejected | patch_failed | tampered | differential_failed | no_report | crashed |
    #              timeout | infra_error
    reward: float | None
    passed_fraction: float = 0.0
    fail_to_pass: dict[str, int] = field(default_factory=dict)  # passed, total
    pass_to_pass: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # expected tests the run did not report
    failed: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)  # canonical files the patch had left as something else
    collection_errors: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)  # what the gate, the tamper or differential checks found
    differential: dict[str, int] = field(default_factory=dict)  # cases, failed: when the check ran
    detail: str = ""
    seconds: float = 0.0

    def conclude(self, status: str, detail: str, reward: float | None = 0.0, evidence: list[str] = ()) -> Verdict:
        self.status, self.reward, self.detail = status, reward, printable(detail, DETAIL_CHARS)
        self.evidence = [printable(e, 160) for e in evidence][:EVIDENCE]
        return self

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Refused(Exception):
    """The sandbox stage found the patch unacceptable (`status`: patch_rejected or patch_failed)."""

    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def patch_paths(patch: str) -> list[str]:
    """Every path a patch names, as `patchparse.parse_patch` (and so `git apply`) reads it."""
    return sorted({p for change in parse_patch(patch) for p in change.paths})


def read_gold(task_dir: Path) -> str:
    """The task's gold patch ('' if it has none yet: synthesis grades the empty patch before writing it), read
    without following a link; TaskFormatError when it is a link, a directory or anything but a regular file."""
    path = Path(task_dir) / "gold.patch"
    if not os.path.lexists(path):
        return ""
    return read_capped(path, MAX_GOLD).decode(errors="replace")


def gate(changes: list[FileChange], task_dir: Path, gold: str | None = None) -> list[str]:
    """Why the parsed patch may not be applied (empty: it may), judged on the host against the task's snapshot;
    `gold` is the task's gold patch (read here when None)."""
    problems = change_problems(changes, task_dir / "snapshot")
    gold = read_gold(task_dir) if gold is None else gold
    problems += [f"added code reaches for test machinery ({f.kind}): {f.evidence}"
                 for f in steering(changes, parse_patch(gold))]
    return problems


def _numstat(output: bytes) -> tuple[set[str], set[bytes]]:
    """(files, modes) from `git apply --numstat --summary -z`: NUL-ended `ADDED\\tDELETED\\tPATH` records, then the
    summary's lines (`create mode 100644 x`, `mode change 100644 => 120000 x`)."""
    *records, summary = output.split(b"\0")
    paths = set()
    for record in records:
        parts = record.split(b"\t", 2)
        if len(parts) != 3:
            raise Refused("patch_rejected", "git apply lists the patch's files in a form the grader cannot read")
        paths.add(parts[2].decode("utf-8", "surrogateescape"))
    return paths, set(re.findall(rb"mode (?:change \d+ => )?(\d{6})", summary))


def apply_patch(sb: Sandbox, patch: str, changes: list[FileChange]) -> None:
    """Apply the patch after git confirmed it names the files the parser read; then no path may be a link."""
    data = patch.encode("utf-8", "surrogateescape")
    listed = sb.run(["sh", "-c", "exec git apply --numstat --summary -z 2>/dev/null"], timeout=120, stdin=data)
    if listed.exit_code == 0 and not listed.timed_out:
        files, modes = _numstat(listed.output)
        if files != {c.new or c.old for c in changes}:
            raise Refused("patch_rejected", "git apply and the grader's parser read different files in the patch "
                                             f"({len(files)} and {len(changes)} file sections)")
        if modes & LINK_MODES:
            raise Refused("patch_rejected", "the patch would create a symbolic link or a submodule")
    applied = sb.run(["git", "apply", "--whitespace=nowarn"], timeout=120, stdin=data)
    if applied.timed_out or applied.exit_code != 0:
        first = applied.output.decode(errors="replace").strip().splitlines()[:1]
        raise Refused("patch_failed", f"the patch does not apply: {first[0] if first else 'git apply failed'}")
    if listed.exit_code != 0 or listed.timed_out:
        raise Refused("patch_rejected", "git could not list the patch's files, yet applied it")
    odd = not_regular(sb, sorted({p for c in changes for p in c.paths}))
    if odd:
        raise Refused("patch_rejected", f"after applying, {len(odd)} path(s) are not regular files: {', '.join(odd)}")


def not_regular(sb: Sandbox, paths: list[str]) -> list[str]:
    """The paths that exist as something other than a regular file (read with lstat: links are not followed)."""
    by_dir: dict[str, list[str]] = {}
    for path in paths:
        p = PurePosixPath(path)
        by_dir.setdefault(str(p.parent), []).append(p.name)
    odd = []
    for directory, names in by_dir.items():
        try:
            entries = sb.listdir(directory)
        except PathError:
            if sb.kind(directory) == "missing":
                continue
            odd += [str(PurePosixPath(directory) / n) for n in names]  # the directory is itself a link
            continue
        kinds = {e.name: e.kind for e in entries}
        absent = "file" if len(entries) <= MAX_DIR_ENTRIES else "unlisted"  # a capped listing proves nothing
        odd += [str(PurePosixPath(directory) / n) for n in names if kinds.get(n, absent) != "file"]
    return odd


def _restore(sb: Sandbox, canonical: dict[str, bytes], canaries: list[Canary]) -> list[str]:
    """Write every canonical file back (canaries appended to their modules); the paths that had to be cleared."""
    extra = {c.module: c.source() for c in canaries}
    cleared = []
    for rel, data in canonical.items():
        data += extra.get(rel, b"")
        try:
            sb.write_bytes(rel, data)
            continue
        except PathError:  # a link or a directory in the way (write_bytes never follows or replaces one)
            cleared.append(rel)
        sb.run(["rm", "-rf", "--", rel], timeout=60)
        try:
            sb.write_bytes(rel, data)
        except PathError as e:
            raise Refused("patch_rejected", f"the canonical test file {rel} could not be restored") from e
    return cleared


def control_run(snapshot: Path, configs: list[str], timeout: float) -> bool:
    """Whether the infrastructure works: a fresh sandbox over the pristine `snapshot` runs a module holding only
    canaries, the way the patch's run went, and every check of it comes out right."""
    canary = Canary.new(f"test_{secrets.token_hex(6)}.py")
    try:
        with Sandbox(snapshot) as sb:
            sb.write_bytes(canary.module, canary.source())
            run = run_suite(sb, [canary.module], timeout=min(timeout, CONTROL_TIMEOUT), configs=configs,
                            canaries=[canary])
    except (OSError, RuntimeError, ValueError):  # TimeoutError, SessionRestarted: OSErrors; PathError: a ValueError
        return False
    forced, off = canary_problems([canary], run)
    return not forced and not off and not run.integrity.problems


def _collection_errors(reported: list[str], test_files: list[str]) -> tuple[list[str], int]:
    """The collection errors that name one of the task's test modules or their directories (dotted, as pytest's
    xunit1 report names them, or as paths), and how many others there were. Anything else in a report is text the
    sandbox chose, so none of it reaches the verdict."""
    known: dict[str, str] = {}
    for rel in test_files:
        path = PurePosixPath(rel)
        module = path.with_suffix("") if rel.endswith(".py") else path
        known[rel] = str(module).replace("/", ".")
        for name in [module, *list(path.parents)[:-1]]:
            known[str(name)] = known[str(name).replace("/", ".")] = str(name).replace("/", ".")
    kept = list(dict.fromkeys(known[e] for e in reported if e in known))
    return kept[:50], sum(e not in known for e in reported)


def _score(verdict: Verdict, task: Task, run: SuiteRun, canaries: list[Canary]) -> None:
    expected = [*task.fail_to_pass, *task.pass_to_pass]
    verdict.missing = [t for t in expected if t not in run.outcomes]
    passed = run.passed
    verdict.failed = [t for t in expected if t in run.outcomes and t not in passed]
    f2p = sum(t in passed for t in task.fail_to_pass)
    p2p = sum(t in passed for t in task.pass_to_pass)
    verdict.fail_to_pass = {"passed": f2p, "total": len(task.fail_to_pass)}
    verdict.pass_to_pass = {"passed": p2p, "total": len(task.pass_to_pass)}
    verdict.passed_fraction = round((f2p + p2p) / max(1, len(expected)), 4)
    verdict.reward = 1.0 if expected and f2p + p2p == len(expected) else 0.0
    verdict.collection_errors, unknown = _collection_errors(run.collection_errors, task.test_files)
    if unknown:  # not proof of tampering (pytest may name a module the task does not list), but worth a look
        verdict.evidence = [f"the report lists {unknown} collection error(s) naming no test module of the task "
                            "(left out of the verdict)"]
    forced, off = canary_problems(canaries, run)
    problems = list(run.integrity.problems)
    if forced:
        problems.insert(0, f"a test that must fail passed in {len(forced)} module(s): the outcomes were forced")
    if off and verdict.reward == 1.0:
        problems.append(f"canary tests are missing or have the wrong outcome in {len(off)} module(s)")
    if problems:
        verdict.conclude("tampered", "the test run was tampered with: " + "; ".join(problems),
                         evidence=[*problems, *run.integrity.changes])


def grade(task: Task, task_dir: Path, patch: str, timeout: float = 900, snapshot: Path | None = None) -> Verdict:
    """Grade `patch`; `snapshot` is a ready sandbox snapshot of the task's `snapshot/` (made here when None).
    Raises `TaskFormatError` for a task that fails its schema; every patch gets a verdict."""
    start = time.monotonic()
    task_dir = Path(task_dir)
    check_task(task, task_dir, str(task_dir / "task.json"))
    canonical = {rel: read_canonical(task_dir, rel) for rel in task.test_files}
    gold = read_gold(task_dir)
    diff = differential.load(task_dir)
    cases = diff.cases if diff is not None else []
    verdict = Verdict(task.id, "graded", 0.0)
    try:
        why = unreadable(patch)
        if why:
            return verdict.conclude("patch_rejected", why)
        changes = parse_patch(patch)
        problems = gate(changes, task_dir, gold)
        if problems:
            return verdict.conclude("patch_rejected", f"the patch may not be applied: {'; '.join(problems)}",
                                    evidence=problems)
        _in_sandbox(verdict, task, task_dir, patch if changes else "", changes, canonical, timeout, snapshot, cases)
        return verdict
    finally:
        verdict.seconds = round(time.monotonic() - start, 2)


def unreadable(patch: str) -> str:
    """Why `patch` is refused unread ('' when it may be parsed): over `MAX_DIFF_BYTES` bytes (the bound is on bytes,
    as `tree_diff` writes them, not on characters), or text that no file can hold (a lone surrogate)."""
    try:
        size = len(patch.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return "the patch is not text a file can hold (it has characters with no UTF-8 encoding)"
    return f"the patch is larger than {MAX_DIFF_BYTES} bytes" if size > MAX_DIFF_BYTES else ""


def _in_sandbox(verdict: Verdict, task: Task, task_dir: Path, patch: str, changes: list[FileChange],
                canonical: dict[str, bytes], timeout: float, snapshot: Path | None, cases: list[Case]) -> None:
    expected_files = {t.split("::", 1)[0] for t in [*task.fail_to_pass, *task.pass_to_pass]}
    canaries = [Canary.new(rel) for rel in sorted(expected_files & set(canonical)) if rel.endswith(".py")]
    configs = top_level_configs(list(canonical))
    try:
        with (contextlib.nullcontext(snapshot) if snapshot is not None
              else snapshot_of(task_dir / "snapshot", host())) as snapshot:
            _run_and_score(verdict, task, patch, changes, canonical, timeout, snapshot, configs, canaries, cases)
    except (OSError, RuntimeError) as e:  # making the snapshot: before any patch reached a sandbox
        verdict.conclude("infra_error", f"the grading sandbox's snapshot could not be made ({type(e).__name__})",
                         reward=None)


def _run_and_score(verdict: Verdict, task: Task, patch: str, changes: list[FileChange], canonical: dict[str, bytes],
                   timeout: float, snapshot: Path, configs: list[str], canaries: list[Canary],
                   cases: list[Case]) -> None:
    try:
        sb = Sandbox(snapshot)
    except (OSError, RuntimeError) as e:
        verdict.conclude("infra_error", f"the grading sandbox did not start ({type(e).__name__})", reward=None)
        return
    failure = ""
    try:
        if changes:
            apply_patch(sb, patch, changes)
        verdict.restored = _restore(sb, canonical, canaries)
        run = run_suite(sb, timeout=timeout, configs=configs, canaries=canaries)
        _score(verdict, task, run, canaries)
        if cases and verdict.status == "graded" and verdict.reward == 1.0:
            results = differential.check(sb, cases, min(timeout, differential.CHECK_SECONDS))
            if results is None:
                failure = "differential_failed:the differential check of the patched code left no readable result"
            else:
                _differential(verdict, cases, results)
    except Refused as r:
        verdict.conclude(r.status, r.detail)
        return
    except TimeoutError:
        verdict.conclude("timeout", f"the test suite ran past its timeout of {timeout:g} s")
        return
    except NoReport as e:
        failure = f"no_report:the test run ended (exit {e.exit_code}) without a readable report"
    except (OSError, RuntimeError, ValueError) as e:
        failure = f"crashed:the sandbox failed during grading ({type(e).__name__})"
    finally:
        _close(sb)
    if failure:
        status, what = failure.split(":", 1)
        if control_run(snapshot, configs, timeout):
            verdict.conclude(status, f"{what}; a control run over the pristine snapshot passed, so the "
                                     "failure is the patch's doing")
            if status == "differential_failed":
                verdict.differential = {"cases": len(cases), "failed": len(cases)}
        else:
            verdict.conclude("infra_error", f"{what}, and a control run over the pristine snapshot failed too: "
                                            "the infrastructure is broken", reward=None)


def _differential(verdict: Verdict, cases: list[Case], results: list[dict]) -> None:
    """Score the differential check: one case whose result differs from the original's scores 0."""
    differ = differential.differences(cases, results)
    verdict.differential = {"cases": len(cases), "failed": len(differ)}
    if differ:
        tests_own = sum(case.origin == "recorded" for _, case, _ in differ)
        verdict.conclude("differential_failed", f"the tests pass, but the code differs from the original on "
                                                f"{len(differ)} of {len(cases)} differential inputs ({tests_own} of "
                                                "them the tests' own calls): it fits the tests, not the feature",
                         evidence=[f"case {i} ({case.origin}) {case.qualname}: {why}" for i, case, why in differ])


def _close(sb: Sandbox) -> None:
    """Close the grading sandbox; a failure to tear it down does not change what the run showed (the next sandbox
    start recovers what is left)."""
    with contextlib.suppress(OSError, RuntimeError):
        sb.close()
