"""The agent loop: generate → parse → execute → append the tool responses → generate again.

One loop serves the CLI agent and RL rollouts alike. Per turn:

1. **Generate** from the running token context (prompt + every earlier completion and observation).
2. **Parse** the completion into calls (`ToolCallParser`). Every *attempted* call that cannot run — malformed or
   cut-off JSON, an unknown tool, a call outside the `<tool_call>` tags, bad arguments — becomes a call with an
   error and an `error_kind`; its error (what was wrong, the expected format with an example, the tools) is its
   tool response, so the episode goes on and the model can correct itself. A call cut off because the turn hit
   `max_new_tokens` says so. Only a turn with no attempted call at all is final.
3. **Execute** the valid calls with the results of running them in call order (a read or a test run after an
   edit sees the edit), running concurrently whatever does not conflict (`ToolExecutor`). Results go back in
   call order, whatever order they finished in.
4. **Append** the responses as token ids rendered by `ChatFormat` (never re-rendering history). The result of a call
   that repeats one of an earlier turn (same tool, same arguments) ends with a one-line note naming that turn
   (`shipyard.harness.trajectory.FirstCalls`; the chat API adds the same note).

The episode stops for exactly one explicit reason: `finished` (a turn with no attempted call), `max_turns`,
`max_tokens` (the context budget is spent), `wall_time`, or `repeated_failures` (that many consecutive turns
in which every call failed, a model that is stuck) — the model's doing, all of them — or one that is not:

- `infra_error`: the engine or the workspace raised `InfraError` (an inference or environment server unreachable or
  erroring, a sandbox that could not be restarted). Faults are data: the episode ends there, the trajectory keeps
  every turn so far (the turn in flight too, with its completion and no calls when its tools failed), and
  `meta["infra_error"]` says where and what (`"tools: EnvServerUnreachable: …"`). The rollout side masks or retries
  it; it is never scored as the model's failure. Any other exception is a bug and propagates.
- `cancelled`: the `cancelled` callback returned True. It is polled before every turn and passed to the engine with
  each request (`GenerationRequest.cancelled`), so a long generation stops between decode steps (the engine returns
  it with finish_reason "abort"; that partial turn is kept, its calls are not run).

Every request carries `session` (the rollout id): engines keep the conversation's KV cache between turns and a
router keeps the conversation on one engine. A turn records the policy version of its oldest token, and per-token
versions when a weight update landed during its completion.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from shipyard.harness.parse import ParsedTurn, ToolCall, ToolCallParser
from shipyard.harness.tools import Searcher, Tool, ToolContext, ToolError, tools_for, truncate_middle
from shipyard.harness.tools.base import display_path
from shipyard.harness.trajectory import CallRecord, FirstCalls, Trajectory, Turn, noted
from shipyard.harness.wire import SYSTEM_PROMPT, ChatFormat, Tags
from shipyard.harness.workspace import PathError, Workspace
from shipyard.models.engine import Completion, Engine, GenerationRequest, SamplingParams
from shipyard.models.errors import InfraError

STOP_REASONS = ("finished", "max_turns", "max_tokens", "wall_time", "repeated_failures", "infra_error", "cancelled")
ANYWHERE = "*"


def _overlap(a: set[str], b: set[str]) -> bool:
    return bool(a and b) and (ANYWHERE in a or ANYWHERE in b or not a.isdisjoint(b))


def _conflict(first: tuple[set[str], set[str]], second: tuple[set[str], set[str]]) -> bool:
    (r1, w1), (r2, w2) = first, second
    return _overlap(w1, r2 | w2) or _overlap(r1, w2)


@dataclass
class LoopConfig:
    """One episode's budgets and wire settings (`[episode.loop]` in the config tree).

    `max_failed_turns`: consecutive turns in which every call failed that end the episode (`repeated_failures`). 5,
    not the 3 it was: a model still learning the call format fails in streaks, and each failure is answered with the
    format and an example it can recover from — the bundled 1.5B, 57% of its turns invalid, ended 5 of 6 episodes on
    the 3rd (issue 29). Were its turns independent, a streak of 3 somewhere in 8 turns has probability 0.55, one of 5
    0.14; a model that is stuck for good still costs at most 5 turns.
    """

    max_turns: int = 30
    max_tokens: int = 32_768
    max_new_tokens: int = 2048
    wall_time: float = 1800.0
    max_failed_turns: int = 5
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    max_output_bytes: int = 16_000
    max_parallel: int = 16
    untagged_calls: Literal["reject", "accept"] = "reject"  # see shipyard.harness.parse
    tags: Tags = "token"  # the call tags as the tag tokens or spelled in ordinary ones: see shipyard.harness.wire
    overview_entries: int = 60  # files listed in the first user turn (0: none)

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_tokens, self.max_new_tokens) < 1:
            raise ValueError(f"episode.loop max_turns, max_tokens and max_new_tokens must be at least 1, got "
                             f"{self.max_turns}, {self.max_tokens} and {self.max_new_tokens}")
        if min(self.max_failed_turns, self.max_parallel, self.max_output_bytes) < 1 or self.overview_entries < 0:
            raise ValueError(f"episode.loop max_failed_turns, max_parallel and max_output_bytes must be at least 1 and "
                             f"overview_entries at least 0, got {self.max_failed_turns}, {self.max_parallel}, "
                             f"{self.max_output_bytes} and {self.overview_entries}")
        if not self.wall_time > 0:
            raise ValueError(f"episode.loop.wall_time must be > 0 seconds, got {self.wall_time}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p)  # the engines' rule, checked when read


class ToolExecutor:
    """Runs one turn's calls with the results of running them in call order, as concurrently as that allows.

    Each call reads and writes a set of paths: a tool with `path_arg` touches that one file (a write if the tool
    `mutates`), `run_terminal` may read and write anything, the other tools read anything. A call waits for every
    earlier call it conflicts with (one writes what the other reads or writes); calls are run in waves, each
    wave concurrently. The one deliberate exception: `run_terminal` calls never wait for each other, so several
    commands in one turn run side by side (docs/harness.md says what they then do not persist).
    """

    def __init__(self, tools: list[Tool], ctx: ToolContext, max_parallel: int = 16):
        self.tools = {t.name: t for t in tools}
        self.ctx = ctx
        self.pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="shipyard-tool")

    def execute(self, calls: list[ToolCall]) -> list[CallRecord]:
        records: dict[int, CallRecord] = {}
        valid = []
        for call in calls:
            if call.error is None:
                valid.append(call)
            else:
                error = self._clean(call.error)
                records[call.index] = CallRecord(call.index, call.name, call.arguments, f"error: {error}", error,
                                                 0.0, call.untagged, call.error_kind)
        self.ctx.concurrent_terminals = sum(c.name == "run_terminal" for c in valid)
        access = [self._access(c) for c in valid]  # resolved once: a sandbox's resolve is a request
        written = {c.index: a[1] for c, a in zip(valid, access, strict=True)}

        def run(call: ToolCall) -> CallRecord:
            return self._run_one(call, written[call.index])

        for wave in self._waves(valid, access):
            if len(wave) == 1:
                records[wave[0].index] = run(wave[0])
                continue
            for call, record in zip(wave, self.pool.map(run, wave), strict=True):
                records[call.index] = record
        return [records[c.index] for c in calls]

    def _access(self, call: ToolCall) -> tuple[set[str], set[str]]:
        """(paths read, paths written); ANYWHERE stands for every path."""
        tool = self.tools[call.name]
        if tool.path_arg is None:
            return ({ANYWHERE}, {ANYWHERE}) if tool.mutates else ({ANYWHERE}, set())
        try:
            path = self.ctx.workspace.resolve(call.arguments.get(tool.path_arg, ""))
        except PathError:
            return set(), set()  # refused before touching anything
        except OSError:  # the workspace could not answer (a sandbox restarting): assume the call touches anything
            return ({ANYWHERE}, {ANYWHERE}) if tool.mutates else ({ANYWHERE}, set())
        return (set(), {path}) if tool.mutates else ({path}, set())

    def _waves(self, calls: list[ToolCall], access: list[tuple[set[str], set[str]]] | None = None
               ) -> list[list[ToolCall]]:
        access = access if access is not None else [self._access(c) for c in calls]
        level: list[int] = []
        for j, call in enumerate(calls):
            deps = [level[i] for i in range(j) if not (call.name == calls[i].name == "run_terminal")
                    and _conflict(access[i], access[j])]
            level.append(1 + max(deps, default=-1))
        return [[c for c, lv in zip(calls, level, strict=True) if lv == w] for w in range(max(level, default=-1) + 1)]

    def _run_one(self, call: ToolCall, written: set[str]) -> CallRecord:
        start = time.perf_counter()
        if self.tools[call.name].mutates:  # the searcher refreshes these before its next query
            self.ctx.wrote(None if ANYWHERE in written else written)
        try:
            output, error, kind = self.tools[call.name].run(self.ctx, **call.arguments), None, None
        except InfraError:  # not the model's doing (many are OSErrors): the episode ends, see Agent.run
            raise
        except (ToolError, PathError, OSError, UnicodeError) as e:
            message = str(e) if isinstance(e, ToolError | PathError) else f"{type(e).__name__}: {e}"
            error = f"tool call #{call.index + 1} ({call.name}) failed: {message}"
            output = f"error: {error}"
            kind = e.kind if isinstance(e, ToolError) else "tool_error"
        error = None if error is None else self._clean(error)
        return CallRecord(call.index, call.name, call.arguments, self._clean(output), error,
                          time.perf_counter() - start, call.untagged, kind)

    def _clean(self, text: str) -> str:
        """What goes back to the model is bounded, valid UTF-8 text whatever a tool or an error message held (a lone
        surrogate from a file name or a JSON argument would make the tokenizer raise and end the episode)."""
        return truncate_middle(text, 2 * self.ctx.max_output_bytes)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


TurnCallback = Callable[[Turn, ParsedTurn], None]


def workspace_overview(workspace: Workspace, max_entries: int) -> str:
    """A short file listing appended to the task, so the model starts from real paths (as Cursor's context)."""
    if max_entries <= 0:
        return ""
    paths = workspace.files(max_entries)
    more = "\n… and more (use list_dir or glob)" if len(paths) > max_entries else ""
    shown = (display_path(p) for p in paths[:max_entries])  # JSON-quoted if odd (newlines, undecodable bytes)
    return "\n\nFiles in the workspace:\n" + "\n".join(shown) + more


class Agent:
    """Runs episodes of one engine in one workspace. `on_turn` is called after each turn (for display); `session` is
    sent with every request (the rollout id); `cancelled`, polled between turns and between decode steps, stops the
    episode with stop reason `cancelled`. With a `searcher`, the episode offers `codebase_search`."""

    def __init__(self, engine: Engine, workspace: Workspace, config: LoopConfig | None = None,
                 tools: list[Tool] | None = None, system_prompt: str = SYSTEM_PROMPT,
                 on_turn: TurnCallback | None = None, *, session: str | None = None,
                 cancelled: Callable[[], bool] | None = None, searcher: Searcher | None = None):
        self.engine = engine
        self.workspace = workspace
        self.config = config or LoopConfig()
        self.searcher = searcher
        self.tools = tools if tools is not None else tools_for(searcher)
        self.format = ChatFormat(engine.tokenizer, self.tools, system_prompt, self.config.tags)
        self.parser = ToolCallParser(self.tools, self.config.untagged_calls)
        self.on_turn = on_turn
        self.session = session
        self.cancelled = cancelled

    def run(self, task: str, out: str | None = None) -> Trajectory:
        cfg = self.config
        start = time.monotonic()
        traj = Trajectory(task=task, model=self.engine.name, prompt_ids=[],
                          meta={"tools": [t.name for t in self.tools], "config": vars(cfg).copy()})
        ctx = ToolContext(self.workspace, max_output_bytes=cfg.max_output_bytes, searcher=self.searcher)
        executor = ToolExecutor(self.tools, ctx, cfg.max_parallel)
        try:
            try:
                overview = workspace_overview(self.workspace, cfg.overview_entries)
            except InfraError as e:
                overview = ""
                _infra_error(traj, "workspace", e)
            traj.prompt_ids = self.format.prompt_ids(task + overview)
            self._turns(traj, executor, start, out)
        finally:
            executor.close()
            try:
                ctx.close()  # stops background jobs: a request to the workspace
            except InfraError as e:
                if traj.stop_reason != "infra_error":
                    _infra_error(traj, "close", e)
            except (OSError, RuntimeError) as e:  # a job already gone with a session the model killed: not a bug
                traj.meta["close_error"] = f"{type(e).__name__}: {e}"[:1000]
        traj.patch = self._diff(traj)
        traj.seconds = time.monotonic() - start
        if out is not None:
            traj.save(out)
        return traj

    def _diff(self, traj: Trajectory) -> str | None:
        """The workspace's patch. An `OSError` is the model's doing (its code killed or stopped the sandbox's session
        during the diff; the session was restarted over the same files), so the diff is taken once more, then the
        patch is empty (graded, typically 0: never a masked reward the model could choose). None after an
        `InfraError` (after an infra error too: a dead engine leaves a workspace worth a look)."""
        for attempt in range(2):
            try:
                return self.workspace.diff()
            except InfraError as e:
                if traj.stop_reason != "infra_error":
                    _infra_error(traj, "diff", e)
                return None
            except OSError as e:
                traj.meta["diff_error"] = f"attempt {attempt + 1}: {type(e).__name__}: {e}"[:1000]
        return ""

    def _turns(self, traj: Trajectory, executor: ToolExecutor, start: float, out: str | None) -> None:
        cfg = self.config
        context = list(traj.prompt_ids)
        failed_streak = 0
        first_calls = FirstCalls()
        while traj.stop_reason is None:
            budget = cfg.max_tokens - len(context)
            if budget <= 0:
                if traj.turns:
                    traj.stop_reason = "max_tokens"
                else:  # not the model's doing: the task does not fit the episode
                    _infra_error(traj, "prompt", PromptTooLong(
                        f"the first prompt is {len(context)} tokens, over episode.loop.max_tokens = {cfg.max_tokens}: "
                        f"raise it, or shorten the statement (or episode.loop.overview_entries)"))
                break
            if time.monotonic() - start > cfg.wall_time:
                traj.stop_reason = "wall_time"
                break
            if self.cancelled is not None and self.cancelled():
                traj.stop_reason = "cancelled"
                break
            sampling = SamplingParams(
                max_tokens=min(cfg.max_new_tokens, budget), temperature=cfg.temperature, top_p=cfg.top_p,
                stop_token_ids=self.format.stop_token_ids,
                seed=None if cfg.seed is None else cfg.seed + len(traj.turns))
            t0 = time.perf_counter()

            def stop_generating() -> bool:  # between decode steps: the episode's budget, or a cancellation
                return time.monotonic() - start > cfg.wall_time or (self.cancelled is not None and self.cancelled())

            try:
                completion = self.engine.generate([GenerationRequest(context, sampling, stop_generating,
                                                                     self.session)])[0]
            except InfraError as e:
                _infra_error(traj, "generate", e)
                break
            gen_seconds = time.perf_counter() - t0
            aborted = completion.finish_reason == "abort"
            parsed = self.parser.parse("" if aborted else completion.text)
            if completion.finish_reason == "length":
                _note_cut(parsed, sampling.max_tokens)
            t1 = time.perf_counter()
            records: list[CallRecord] = []
            try:
                records = executor.execute(parsed.calls) if parsed.calls else []
                _note_repeats(first_calls, parsed, records, len(traj.turns) + 1)
                observation = (self.format.continuation_ids(completion.token_ids, [r.output for r in records])
                               if records else [])
            except InfraError as e:
                records, observation = [], []
                _infra_error(traj, "tools", e)
            turn = self._turn(traj, completion, records, observation, len(parsed.valid_calls), gen_seconds,
                              time.perf_counter() - t1)
            context += completion.token_ids + observation
            failed_streak = failed_streak + 1 if records and turn.failed_calls == len(records) else 0
            if traj.stop_reason is not None:
                pass
            elif aborted:  # the engine stopped it between decode steps: the wall-time budget or `cancelled`
                if self.cancelled is not None and self.cancelled():
                    traj.stop_reason = "cancelled"
                elif time.monotonic() - start > cfg.wall_time:
                    traj.stop_reason = "wall_time"  # the model's time ran out mid-turn: scored, not masked
                else:
                    _infra_error(traj, "generate", InfraError(f"{self.engine.name} aborted the completion"))
            elif parsed.is_final:
                traj.stop_reason = "finished"
            elif failed_streak >= cfg.max_failed_turns:
                traj.stop_reason = "repeated_failures"
            elif len(traj.turns) >= cfg.max_turns:
                traj.stop_reason = "max_turns"
            traj.seconds = time.monotonic() - start
            if self.on_turn is not None:
                self.on_turn(turn, parsed)
            if out is not None:
                traj.save(out)

    @staticmethod
    def _turn(traj: Trajectory, completion: Completion, records: list[CallRecord], observation: list[int],
              width: int, gen_seconds: float, tool_seconds: float) -> Turn:
        turn = Turn(index=len(traj.turns), text=completion.text, completion_ids=completion.token_ids,
                    logprobs=completion.logprobs, finish_reason=completion.finish_reason,
                    observation_ids=observation, calls=records, parallel_width=width if records else 0,
                    generate_seconds=gen_seconds, tools_seconds=tool_seconds,
                    policy_version=completion.policy_version, token_versions=list(completion.token_versions))
        traj.turns.append(turn)
        return turn


def _note_repeats(first_calls: FirstCalls, parsed: ParsedTurn, records: list[CallRecord], turn: int) -> None:
    """Add the repeat note (`FirstCalls`) to the result of each call that ran and repeats one of an earlier turn."""
    for call, record in zip(parsed.calls, records, strict=True):
        if call.error is None and (first := first_calls.repeats(record.key, turn)) is not None:
            record.output = noted(record.output, first)


def _note_cut(parsed: ParsedTurn, max_tokens: int) -> None:
    """Tell the model why its call was cut off when the turn hit the token limit (it cannot see that limit)."""
    for call in parsed.calls:
        if call.error_kind == "truncated" and call.error is not None:
            call.error += (f"\nYour turn was cut off at the limit of {max_tokens} new tokens per turn "
                           "(max_new_tokens): write shorter calls (edit with search_replace rather than rewriting a "
                           "whole file; split long work over several turns).")


class PromptTooLong(InfraError):
    """An episode's first prompt (system, tools, statement, overview) is over its token budget: it cannot run, and a
    reward of 0 would score the configuration as the model's failure. Masked with its cause, as infrastructure is."""


def _infra_error(traj: Trajectory, stage: str, error: BaseException) -> None:
    """End the episode on an infrastructure failure: stop reason `infra_error`, the cause in `meta`."""
    traj.stop_reason = "infra_error"
    traj.meta["infra_error"] = f"{stage}: {type(error).__name__}: {error}"[:1000]
