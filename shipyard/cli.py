"""The `shipyard` command line (typer): the commands README.md lists, each a thin shell over the library
(docs/architecture.md); every long job shows progress.

Errors a user can fix (a bad path, an unknown model, an unreachable server, a malformed replay file: the
`shipyard.errors.UserError` types) are printed as one clear line and exit with status 2, not as a traceback. Any
other exception is a bug: its traceback is printed and the status is 1.
"""

from __future__ import annotations

import json
import re
import sys
import time
from contextlib import closing
from pathlib import Path

import typer
from rich.markup import escape

from shipyard.console import (
    EXTRA_ARGS,
    MODEL_HELP,
    SEARCH_HELP,
    TAGS_HELP,
    UNTAGGED_HELP,
    check_shown,
    compare_shown,
    console,
    eval_shown,
    finish_eval,
    load_config_help,
    need,
    out,
    print_hits,
    print_notes,
    progress_bar,
    run_bench,
    run_configured,
    sft_shown,
    status_line,
    synth_shown,
    train_shown,
    user_errors,
)
from shipyard.errors import UserError
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.search import Mode

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train fast coding agents with RL in the harness they ship in.")
@app.command()
def agent(
    task: str = typer.Argument(..., help="What the agent should do, in plain language."),
    repo: Path = typer.Option(Path("."), "--repo", help="The repository to work in (edited in place)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help=MODEL_HELP),
    sandbox: bool = typer.Option(False, "--sandbox", help="Work in a sandbox over a snapshot of --repo; --repo is "
                                 "never modified and the patch is written to --artifacts."),
    artifacts: Path | None = typer.Option(None, "--artifacts", help="With --sandbox: where the patch, trajectory "
                                          "and summary go (default ./shipyard-runs/<time>)."),
    max_turns: int = typer.Option(30, "--max-turns", min=1),
    out_path: Path | None = typer.Option(None, "--out", help="Save the trajectory here as JSON (after every turn)."),
    temperature: float = typer.Option(0.7, min=0.0),
    seed: int | None = typer.Option(None, help="Seed for sampling (reproducible episodes)."),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", min=1, help="Token budget of one turn."),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:1, …"),
    tokenizer: str | None = typer.Option(None, help="Tokenizer for openai:/replay: models (default: inferred)."),
    untagged: str | None = typer.Option(None, help=UNTAGGED_HELP),
    tags: str | None = typer.Option(None, help=TAGS_HELP),
    search: bool = typer.Option(False, "--search", help=SEARCH_HELP),
) -> None:
    """Run the coding agent on a repository and print each turn, the diff and a summary."""
    from shipyard.models.resolve import make_engine
    from shipyard.rollout.episode import episode_config
    from shipyard.rollout.interactive import run_shown

    with user_errors():
        need(artifacts is None or sandbox, "--artifacts only applies with --sandbox")
        if sandbox and artifacts is None:
            artifacts = Path("shipyard-runs") / time.strftime("%Y%m%d-%H%M%S")
        need(repo.is_dir(), f"--repo {repo} is not a directory")
        config = episode_config(model, max_turns=max_turns, temperature=temperature, seed=seed,
                                max_new_tokens=max_new_tokens, untagged_calls=untagged, tags=tags, search=search)
        with console.status(escape(f"loading model {model}")):
            engine = make_engine(model, device=device, tokenizer=tokenizer, status=status_line)
        with closing(engine):
            traj = run_shown(task, repo, engine, config, console, sandbox_dir=artifacts if sandbox else None,
                             out=out_path)
        if traj.stop_reason == "infra_error":
            raise UserError(f"the episode stopped on an infrastructure failure, not the model's doing: "
                            f"{traj.meta.get('infra_error')}")


@app.command()
def search(
    query: str = typer.Argument(..., help="What the code does, in plain language (or names and keywords)."),
    repo: Path = typer.Option(Path("."), "--repo", help="The repository to search (indexed on first use, then "
                              "refreshed with what changed)."),
    k: int = typer.Option(10, "-k", min=1, max=200, help="Results to show."),
    mode: Mode = typer.Option("hybrid", help="hybrid (meaning and words), semantic or bm25."),
    directory: list[str] | None = typer.Option(None, "--dir", help="Only under this directory (repeatable)."),
    index: Path | None = typer.Option(None, "--index", help="Index directory. Default: $SHIPYARD_HOME/search/…"),
    embedder: str = typer.Option("minilm", help="Embedding model: minilm (bundled), a model directory or a hub id."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as one JSON object."),
) -> None:
    """Search a repository's code by meaning: syntax-aware chunks, embeddings and BM25 (docs/search.md)."""
    from shipyard.search.embed import SentenceEmbedder
    from shipyard.search.index import IndexError_
    from shipyard.search.service import open_repo_index

    with user_errors():
        need(repo.is_dir(), f"--repo {repo} is not a directory")
        with console.status(escape(f"loading embedder {embedder}")):
            model = SentenceEmbedder(embedder)
        with progress_bar("[bold]embedding[/]", "") as bar:
            job = bar.add_task("index", total=None)
            try:
                idx, report = open_repo_index(repo, model, index, progress=lambda d, t: bar.update(job, completed=d,
                                                                                                    total=t))
            except IndexError_ as e:
                raise UserError(f"{e} (or give another --index)") from None
        hits = idx.search(query, k, mode=mode, dirs=directory)
    status_line(f"index {idx.directory}: {idx.live_chunks()} chunks; {len(report.files_changed)} files (re)indexed, "
                f"{report.chunks_embedded} chunks embedded in {report.seconds:.1f} s")
    print_hits(query, hits, as_json)


@app.command("train-embedder")
def train_embedder(
    rollouts: list[Path] = typer.Argument(..., help="Saved rollouts: a run's trajectories/step-*.jsonl, or "
                                          "`shipyard eval --rollouts` files."),
    tasks: Path = typer.Option(..., "--tasks", help="The task set the rollouts ran on (its snapshots: the chunks)."),
    out_dir: Path = typer.Option(..., "--out", help="Where the tuned embedder is saved (use it as --embedder OUT)."),
    base: str = typer.Option("minilm", "--embedder", help="The embedder to start from."),
    epochs: int = typer.Option(2, min=1),
    lr: float = typer.Option(2e-5, min=0.0),
    held_out: float = typer.Option(0.25, "--held-out", min=0.0, max=0.9, help="Share of tasks held out."),
    seed: int = typer.Option(0),
) -> None:
    """Fine-tune the search embedder on what rewarded agent sessions used after each query; report held-out
    recall@10 before and after (docs/search.md)."""
    from shipyard.search.finetune import train_embedder as run

    with user_errors():
        for path in rollouts:
            need(path.is_file(), f"{path} is not a file of saved rollouts")
        with console.status("pairs, base recall, training, tuned recall"):
            report = run(rollouts, tasks, out_dir, base=base, epochs=epochs, lr=lr, held_out=held_out, seed=seed)
    out.print_json(json.dumps(report))
    if report["recall@10_tuned"] < report["recall@10_base"]:
        console.print("[bold red]the tuned embedder is worse on the held-out tasks than the base one[/] "
                      + escape(f"(kept in {out_dir} for inspection; do not use it)"), soft_wrap=True)
        raise typer.Exit(1)


@app.command(context_settings=EXTRA_ARGS)
def demo(ctx: typer.Context) -> None:
    """The whole RL loop on this machine: tasks synthesized from the example library, the bundled model evaluated,
    trained for a few steps and evaluated again; a before/after table. configs/demo.toml; any key may follow as
    --SECTION.KEY VALUE (`shipyard demo --run.steps 2`). Exits non-zero if the loop failed."""
    from shipyard.models.errors import InfraError
    from shipyard.rl.demo import demo_config, report

    with user_errors():
        cfg = demo_config(ctx.args)
        console.print(f"[bold]demo[/]: {cfg.run.steps} RL steps of {escape(cfg.model.name)} on tasks synthesized "
                      f"from {escape(str(cfg.run.synth_from))}; run directory {escape(str(cfg.run.dir))}")
        try:
            result = report(train_shown(cfg, ["demo", *ctx.args]), cfg.run.steps)
        except InfraError as e:  # the run gave up: its run.json, eval/ and rollouts.jsonl hold what happened
            console.print(f"[bold red]the loop failed:[/] {escape(str(e))} (run directory {escape(str(cfg.run.dir))})",
                          soft_wrap=True)
            raise typer.Exit(1) from None
    console.print(*result.tables())
    sys.stdout.write(json.dumps({"run": str(cfg.run.dir), **result.to_json()}, default=str) + "\n")  # one line, last
    sys.stdout.flush()
    if not result.ok:
        console.print("[bold red]the loop failed:[/] " + "; ".join(result.failures), soft_wrap=True)
        raise typer.Exit(1)


@app.command()
def serve(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8000, min=1, max=65535),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="Most requests generated together."),
    device: str = typer.Option("cpu"),
    max_tokens_limit: int = typer.Option(4096, "--max-tokens-limit", min=1,
                                         help="Most tokens one completion may ask for; more is refused (400)."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", min=2,
                                             help="Most prompt + completion tokens. Default: the model's context."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="SHIPYARD_API_KEY", show_envvar=True,
                                       help="Require this bearer key on /v1/completions and /v1/models (prefer the "
                                            "environment variable: a command line is visible to other users)."),
    max_body_mb: int = typer.Option(8, "--max-body-mb", min=1, help="Largest completions request body."),
    max_weights_mb: int = typer.Option(4096, "--max-weights-mb", min=1,
                                       help="Largest weight push (POST /v1/weights); a 0.5B model in bf16 is ~1000."),
    max_connections: int = typer.Option(256, "--max-connections", min=1, help="Open connections; beyond: 503."),
) -> None:
    """Serve a model on OpenAI-compatible /v1/completions (token ids + logprobs) and /v1/chat/completions (tools and
    tool_calls, in the harness's wire format) endpoints.

    Weight pushes (POST /v1/weights) need a bearer token: $SHIPYARD_SERVE_TOKEN (or the file in
    $SHIPYARD_SERVE_TOKEN_FILE) if set, else a fresh one written to $SHIPYARD_HOME/serve/PORT.token (mode 0600),
    where `shipyard.train.sync.push_http` finds it (`shipyard.models.payload.token_path`)."""
    from shipyard.harness.chat_api import add_chat_completions
    from shipyard.httpguard import server_token, store_token
    from shipyard.models.payload import TOKEN_ENV, token_path
    from shipyard.models.resolve import make_engine
    from shipyard.models.server import ServeConfig, create_app, run
    from shipyard.rollout.episode import wire_defaults

    with user_errors():
        need(not model.startswith("openai:"), "serve needs a local model, not openai:")
        token, where = server_token(TOKEN_ENV)
        where = where or store_token(token_path(port), token, TOKEN_ENV)
        wire = wire_defaults(model)
        engine = make_engine(model, device=device, status=status_line)
    config = ServeConfig(token=token, api_key=api_key or None, max_tokens=max_tokens_limit, max_model_len=max_model_len,
                         max_batch=max_batch, max_body=max_body_mb << 20, max_weights_body=max_weights_mb << 20)
    console.print(f"serving [bold]{escape(model)}[/] on http://{host}:{port}/v1"
                  + (" (API key required)" if config.api_key else ""), soft_wrap=True)
    console.print(f"weights token for POST /v1/weights: {where}", soft_wrap=True, markup=False)
    served = create_app(engine, model, config)
    add_chat_completions(served, engine, model, wire.untagged_calls, wire.tags)
    run(served, host, port, max_connections=max_connections)


sandbox_app = typer.Typer(no_args_is_help=True, help="Run commands in bubblewrap sandboxes.")
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("exec")
def sandbox_exec(
    command: list[str] = typer.Argument(..., help="The command and its arguments (put them after --)."),
    repo: Path = typer.Option(..., "--repo", help="Directory the sandbox's workspace starts from (never modified)."),
    timeout: float = typer.Option(600, min=0.1, help="Seconds before the sandbox is killed."),
    memory: int = typer.Option(4096, "--memory", min=16, help="Memory limit in MB."),
    pids: int = typer.Option(512, min=8, help="Most processes and threads."),
    disk: int = typer.Option(4096, "--disk", min=1, help="Most MB the command may write to the workspace."),
) -> None:
    """Run one command in a fresh sandbox over DIR; print its output and exit with its exit code."""
    from shipyard.sandbox.bwrap import Limits
    from shipyard.sandbox.host import host
    from shipyard.sandbox.run import run_in_sandbox
    from shipyard.sandbox.snapshot import snapshot_of

    with user_errors():
        need(repo.is_dir(), f"--repo {repo} is not a directory")
        print_notes(host().notes)
        with snapshot_of(repo, host()) as snapshot:
            limits = Limits(memory_mb=memory, pids=pids, disk_mb=disk)
            result = run_in_sandbox(snapshot, command, timeout=timeout, limits=limits)
    sys.stdout.buffer.write(result.output)
    if result.dropped_bytes:
        console.print(f"[yellow][... {result.dropped_bytes} bytes of output dropped from the middle][/]")
    if result.timed_out:
        console.print(f"[red]timed out after {timeout:g} s; the sandbox was killed[/]")
        raise typer.Exit(124)
    raise typer.Exit(result.exit_code)


@app.command()
def dashboard(
    runs: Path = typer.Option(..., "--runs", help="A run directory (`shipyard train`'s run.dir) or a folder of them."),
    env_server: str | None = typer.Option(None, "--env-server", help="Show this environment server's sandbox fleet "
                                          "(http://HOST:PORT; its token is found as `shipyard eval` finds it)."),
    host_: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (loopback by default)."),
    port: int = typer.Option(8300, min=1, max=65535),
) -> None:
    """Training curves, trajectories (turns, parallel calls, diffs, hints, monitor flags), evals side by side, tasks
    and the sandbox fleet in a browser, updating live. Open the printed link: it carries the token every request
    needs ($SHIPYARD_DASHBOARD_TOKEN if set, else a fresh one) in its fragment, which the browser never sends."""
    import uvicorn

    from shipyard.dashboard.app import TOKEN_ENV, announce, create_app
    from shipyard.httpguard import server_token

    with user_errors():
        need(runs.is_dir(), f"--runs {runs} is not a directory")
        token, where = server_token(TOKEN_ENV)
        served = create_app(runs, token=token, env_server=env_server, host=host_)
    for line in announce(runs, host_, port, token, shown_token=where is None):
        console.print(line, soft_wrap=True, markup=False, style="yellow" if line.startswith("note:") else None)
    uvicorn.run(served, host=host_, port=port, log_level="warning")


@app.command("env-server")
def env_server(
    host_: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8100, min=1, max=65535),
    max_live: int = typer.Option(256, "--max-live", min=1, help="Most sandboxes alive at once."),
    max_starting: int = typer.Option(8, "--max-starting", min=1, help="Most sandboxes starting at once."),
    max_queue: int = typer.Option(512, "--max-queue", min=0, help="Most starts waiting; beyond: 503 Retry-After."),
    idle_timeout: float = typer.Option(1800, "--idle-timeout", min=1, help="Seconds before an idle sandbox is reaped."),
    warm_pool: int = typer.Option(0, "--warm-pool", min=0, help="Started sandboxes kept ready per snapshot."),
    allow_root: list[Path] | None = typer.Option(None, "--allow-root", help="A directory whose subtree clients may "
                                                 "snapshot (repeatable). Default: the current directory."),
    token_file: Path | None = typer.Option(None, "--token-file", help="Where to write the bearer token clients must "
                                           "send (mode 0600). Default: $SHIPYARD_HOME/env-server/PORT.token."),
    print_token: bool = typer.Option(False, "--print-token", help="Also print the token itself (it is a secret)."),
    max_body_mb: int = typer.Option(64, "--max-body-mb", min=1, help="Largest request body (a file write's data)."),
    max_snapshot_mb: int = typer.Option(2048, "--max-snapshot-mb", min=1, help="Most bytes one snapshot may copy."),
    max_snapshot_files: int = typer.Option(200_000, "--max-snapshot-files", min=1, help="Most entries in a snapshot."),
    keep_outward_links: bool = typer.Option(False, "--keep-outward-links", help="Copy symlinks that lead out of a "
                                            "snapshot's tree (a .venv's bin/python) instead of refusing the tree."),
    max_grading: int = typer.Option(4, "--max-grading", min=1, help="Most grades (test-suite runs) at once."),
    max_grade_queue: int = typer.Option(64, "--max-grade-queue", min=0, help="Most grades waiting; beyond: 503."),
    max_task_snapshots: int = typer.Option(64, "--max-task-snapshots", min=1, help="Task snapshots kept cached for "
                                           "task sandboxes and grading (least recently used removed first)."),
    max_task_snapshot_gb: int = typer.Option(32, "--max-task-snapshot-gb", min=1, help="Their bytes together."),
    shutdown_grace: float = typer.Option(5, "--shutdown-grace", min=0, help="Seconds a shutdown waits for requests "
                                         "in flight (grades take minutes: past this they are abandoned)."),
) -> None:
    """Serve sandboxes over HTTP (create from snapshots, exec, files, diff, destroy; /metrics), and tasks: sandboxes
    over a task directory's cached snapshot (POST /tasks/sandboxes) and grading from it (POST /grade).

    Every request but /health needs the bearer token: $SHIPYARD_ENV_TOKEN (or the file in $SHIPYARD_ENV_TOKEN_FILE)
    if set, else a fresh one written to --token-file, where `EnvClient` on this host finds it."""
    import uvicorn

    from shipyard.httpguard import server_token, store_token
    from shipyard.rollout.setup import check_sandboxes
    from shipyard.sandbox.client import TOKEN_ENV
    from shipyard.sandbox.client import token_file as default_token_file
    from shipyard.sandbox.host import host
    from shipyard.sandbox.server import ServerConfig, create_app
    from shipyard.sandbox.snapshot import CopyBounds

    with user_errors():
        check_sandboxes()  # SandboxesUnavailable: one line, exit 2
        print_notes(host().notes)
        token, where = server_token(TOKEN_ENV)
        token_file = None if where else token_file or default_token_file(port)
        config = ServerConfig(token=token, allowed_roots=tuple(allow_root or [Path.cwd()]), token_file=token_file,
                              max_live=max_live, max_starting=max_starting, max_queue=max_queue,
                              idle_timeout=idle_timeout, warm_pool=warm_pool, max_body=max_body_mb << 20,
                              copy=CopyBounds(max_bytes=max_snapshot_mb << 20, max_files=max_snapshot_files,
                                              keep_outward_links=keep_outward_links),
                              max_grading=max_grading, max_grade_queue=max_grade_queue,
                              max_task_snapshots=max_task_snapshots, max_task_snapshot_bytes=max_task_snapshot_gb << 30,
                              shutdown_grace=shutdown_grace)
        server_app = create_app(config)  # checks the config before the token is written anywhere
        if where is None:
            where = store_token(token_file, token, TOKEN_ENV)
    for line in (f"environment server on http://{host_}:{port} (sandbox uid {host().uid}, cgroup {host().cgroup})",
                 f"token: {where}" + (f" = {token}" if print_token else ""),
                 f"clients may snapshot directories under: {', '.join(str(r) for r in server_app.state.env.roots)}"):
        console.print(line, soft_wrap=True, markup=False)
    uvicorn.run(server_app, host=host_, port=port, log_level="warning", timeout_graceful_shutdown=shutdown_grace)


@app.command()
def synth(
    repo: list[str] | None = typer.Option(None, "--repo", help="A repository (repeatable): a directory with a pytest "
                                          "suite (never modified), or name or name==version of an sdist on PyPI. "
                                          "With --from: the source of a project of the pack (default: its release)."),
    repos: list[Path] | None = typer.Option(None, "--repos", help="A file of --repo values, one a line (repeatable)."),
    out: Path = typer.Option(..., "--out", help="The task-set directory to write or append to (docs/tasks.md)."),
    max_tasks: int | None = typer.Option(None, "--max-tasks", min=1, help="Stop after this many validated tasks per "
                                         "project (default 20)."),
    tier: list[int] | None = typer.Option(None, "--tier", min=1, max=3, help="Tiers to make (repeatable): 1 one "
                                          "body, 2 several bodies of a feature, 3 whole definitions. Default: all."),
    timeout: float = typer.Option(900, min=1, help="Seconds one run of the test suite may take."),
    with_: list[str] | None = typer.Option(None, "--with", help="A requirement the tests need that the repo does not "
                                           "declare, as `pip install` takes it (repeatable): --with hypothesis"),
    skip_done: bool = typer.Option(False, "--skip-done", help="Skip the projects the task set already holds tasks "
                                   "of (to finish an interrupted build) instead of refusing them."),
    from_: Path | None = typer.Option(None, "--from", help="Rebuild the tasks of this pack (`shipyard pack`) instead "
                                      "of synthesizing: minutes, not CPU hours."),
    check: bool = typer.Option(True, "--check/--no-check", help="With --from: grade each rebuilt task again (empty "
                               "patch fails, gold passes) before keeping it. --no-check trusts the pack's test lists: "
                               "only for a pack you made."),
) -> None:
    """Feature-deletion tasks of each repository into one task set, validated in sandboxes, graded by the tests."""
    from shipyard.tasks.pool import specs_of
    from shipyard.tasks.synth import SynthConfig

    with user_errors():
        need(from_ is None or not (max_tasks is not None or tier or with_), "--from rebuilds a pack's tasks as they "
             "are: --max-tasks, --tier and --with apply to synthesis only")
        config = SynthConfig(max_tasks=20 if max_tasks is None else max_tasks,
                             tiers=tuple(sorted(set(tier or (1, 2, 3)))), timeout=timeout,
                             requirements=tuple(with_ or ()))
        specs = specs_of(repo or (), repos or ()) if from_ is None or repo or repos else []
        reports = synth_shown(specs, out, config, skip_done, from_, check)
    if not any(report.accepted for report in reports) or (from_ and any(report.rejections for report in reports)):
        raise typer.Exit(1)  # nothing made, or a pack rebuilt in part (the tasks left out are named above)


@app.command()
def pack(
    tasks: Path = typer.Option(..., "--tasks", help="A task-set directory made by `shipyard synth`."),
    out_path: Path = typer.Option(..., "--out", help="The pack to write (gzip'd JSON lines, e.g. pool.pack.gz)."),
) -> None:
    """Write a task set as one small file that `shipyard synth --from` rebuilds anywhere (docs/tasks.md)."""
    from shipyard.tasks.pack import write_pack

    with user_errors():
        projects, count = write_pack(tasks, out_path)
    console.print(f"[green]{count} tasks[/] of {projects} projects in {escape(str(out_path))} "
                  f"({out_path.stat().st_size:,} bytes)")


@app.command()
def grade(
    tasks: Path = typer.Option(..., "--tasks", help="A task-set directory made by `shipyard synth`."),
    task: str = typer.Option(..., "--task", help="The task id (a directory name in the task set)."),
    patch: Path = typer.Option(..., "--patch", help="A `git diff` patch relative to the snapshot root."),
    timeout: float = typer.Option(900, min=1, help="Seconds the test suite may take."),
) -> None:
    """Grade a patch in a fresh sandbox; print the verdict as JSON (exit 0 reward 1, 1 reward 0 — failed, rejected,
    tampered with, crashed or timed out —, 3 infra error: reward null, the control run failed too)."""
    from shipyard.tasks.grade import grade as grade_patch
    from shipyard.tasks.taskset import load_task

    with user_errors():  # a malformed task set or task is a TaskFormatError (a UserError): one line, exit 2
        need(patch.is_file(), f"--patch {patch} is not a file")
        loaded, task_dir = load_task(tasks, task)
        verdict = grade_patch(loaded, task_dir, patch.read_text(errors="replace"), timeout=timeout)
    out.print_json(json.dumps(verdict.to_json()))
    raise typer.Exit(0 if verdict.reward == 1.0 else 3 if verdict.reward is None else 1)


@app.command("eval", context_settings=EXTRA_ARGS)
def eval_(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help=escape(
        "A run's TOML (configs/learning.toml): the episodes run with its [episode] (the wire settings of --model "
        "unless it sets them), [rollout] max_infra_retries and rollout_time_budget, [engine] device, [model] "
        "tokenizer, [vllm] servers (for vllm:MODEL) and [run] seed. Any field may follow as --SECTION.KEY VALUE "
        "(--episode.loop.max_turns 8; `shipyard eval -- --help` lists them); without --config, the defaults.")),
    tasks: Path | None = typer.Option(None, "--tasks", help="A task-set directory made by `shipyard synth` (held-out "
                                      "tasks)."),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP + " replay:gold replays each task's "
                                     "gold patch with the harness's tools (pass@1 must be 1.0)."),
    samples: int = typer.Option(1, "--samples", min=1, help="Rollouts per task (pass@k needs k <= samples)."),
    k: list[int] | None = typer.Option(None, "--k", min=1, help="Report pass@k for this k (repeatable). Default: "
                                       "1, 2, 4, … and --samples."),
    out_path: Path | None = typer.Option(None, "--out", help="Write the results (or, with --compare, the comparison) "
                                         "as JSON here."),
    markdown_path: Path | None = typer.Option(None, "--markdown", help="Also write the markdown table here."),
    rollouts_path: Path | None = typer.Option(None, "--rollouts", help="Append every rollout record, trajectory "
                                              "included, to this JSON-lines file."),
    resume: bool = typer.Option(False, "--resume", help="Continue the stopped eval whose --rollouts file this is: "
                                "its scored rollouts are kept, the rest run (same settings required)."),
    compare_files: tuple[Path, Path] | None = typer.Option(
        None, "--compare", show_default=False, help="Compare two result files (A B): B − A per task and overall. "
        "Runs no eval."),
    task: list[str] | None = typer.Option(None, "--task", help="Evaluate only this task id (repeatable)."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Episodes at once."),
    env_server: str | None = typer.Option(None, "--env-server", help="Run sandboxes and grading on this environment "
                                          "server (http://HOST:PORT; it must see --tasks at the same path). "
                                          "Default: bubblewrap sandboxes in this process."),
    baseline: bool = typer.Option(False, "--baseline", help="Also record the per-task pass rates as the model's "
                                  "baseline in TASKS/baseline/MODEL.json (curriculum.baseline reads it)."),
) -> None:
    """Evaluate a model on held-out tasks without training: pass@1, unbiased pass@k, effort, infra failures and
    monitor flags per task and overall (a markdown table on stdout; JSON with --out). The episodes are configured as
    a training run's: --config FILE and --SECTION.KEY VALUE overrides (docs/training.md, "Configuration"). Exit 0
    when the eval ran (pass@1 0 included), 1 when no rollout could be scored (infrastructure), 2 for a usage error."""
    with user_errors():
        if {"--help", "-h"} & set(ctx.args):  # `shipyard eval -- --help`: the configuration's fields
            load_config_help(config)
        misspelt = [a for a in ctx.args if re.match(r"-+[^-\d.]", a) and "." not in a.split("=")[0]  # not -1
                    and a.lstrip("-").lower() not in ("inf", "infinity", "nan")]
        need(not misspelt, f"eval has no option {misspelt[0] if misspelt else ''} (`shipyard eval --help` lists its "
             "options; the episodes' settings are configuration fields: --SECTION.KEY VALUE, e.g. "
             "--episode.loop.max_turns 8)")
        if compare_files is not None:
            need(model is None and tasks is None and not baseline and config is None and not ctx.args,
                 "--compare reads two result files and runs no eval: leave out --model, --tasks, --baseline, --config "
                 "and configuration fields")
            doc, table = compare_shown(*compare_files)
        else:
            need(tasks is not None and model is not None, "eval needs --tasks DIR and --model M (or --compare A.json "
                 "B.json)")
            need(rollouts_path is not None or not resume, "--resume continues the eval journalled in --rollouts FILE")
            run = {"samples": samples, "ks": k or None, "concurrency": concurrency}
            doc, table = eval_shown(tasks, task, model, run, config, ctx.args, env_server, rollouts_path, resume)
    finish_eval(doc, table, out_path, markdown_path, baseline=tasks if baseline else None, check=not compare_files)


@app.command(context_settings=EXTRA_ARGS)
def train(ctx: typer.Context,
          config: Path = typer.Argument(..., help="The run's TOML (configs/cpu.toml). Any field may follow as "
                                        "--SECTION.KEY VALUE; `shipyard train CONFIG -- --help` lists them."),
          check: bool = typer.Option(False, "--check", help="Resolve the configuration and say what the run would "
                                     "start (ranks, devices, servers, tasks) and what this machine lacks; start "
                                     "nothing.")) -> None:
    """Train the agent with RL: rollouts, rewards, trainer steps, weight sync, checkpoints, held-out evals."""
    if check:
        run_configured(check_shown, config, ctx.args)
        return
    cfg, lines = run_configured(train_shown, config, ctx.args)
    evals = [line for line in lines if any(k.startswith("eval/") for k in line)]
    out.print_json(json.dumps({"run": str(cfg.run.dir), "steps": cfg.run.steps, "last": lines[-1] if lines else None,
                               "evals": evals}))


@app.command(context_settings=EXTRA_ARGS)
def sft(ctx: typer.Context,
        config: Path = typer.Argument(..., help="The run's TOML (configs/cpu-sft.toml): its sft section names the "
                                      "demonstrations; any field may follow as --SECTION.KEY VALUE.")) -> None:
    """Supervised fine-tuning on successful trajectories (gold replays, rejection-sampled or the policy's own): the
    cold start before RL, with the same trainer, run directory, checkpoints and export as `shipyard train`."""
    cfg, lines = run_configured(sft_shown, config, ctx.args)
    out.print_json(json.dumps({"run": str(cfg.run.dir), "export": str(cfg.run.dir / "export"), "steps": len(lines),
                               "last": lines[-1] if lines else None}))


@app.command()
def bench(name: str = typer.Argument(..., help="Benchmark name: a module of shipyard/bench (see docs/benchmarks.md)."),
          args: list[str] | None = typer.Argument(None, help="Arguments passed to the benchmark.")) -> None:
    """Run a benchmark (shipyard.bench.NAME): readable tables, then its figures as JSON on the last line."""
    with user_errors():
        run_bench(name, args or [])


if __name__ == "__main__":
    app()
