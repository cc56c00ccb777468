"""The code-search index where it is used: over an agent's workspace (`IndexSearcher`, the `codebase_search`
tool's backend) and over a repository on this machine (`repo_index`, for `shipyard search` and the CLI agent).

**In an episode** the index must follow the agent's own edits without ever embedding the whole repository again. A
task's index is built once, at synthesis, outside its snapshot; an episode opens a private copy of it (hard links:
the index's files are only ever replaced, never written in place, so a copy costs no bytes and two episodes of one
task cannot disturb each other or the original) and, before each query, refreshes the files written since the last
one. The tool layer knows them exactly when they came from the editing tools (`ToolContext.changed`); after a
terminal command, which may have written anything, they come from the workspace's diff against its baseline, plus
every file refreshed before (one reverted since must go back to its original chunks). Either way only those files
are read, hashed and — if their bytes changed — re-chunked and re-embedded. A workspace without a prebuilt index
gets one built from its files on the first query (once per episode).

**On this machine** an index per repository lives in `$SHIPYARD_HOME/search/` (mode 0700: it holds the code's
text), refreshed incrementally on every use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from shipyard.harness.confined import PathError
from shipyard.harness.tools.search import SearchResult
from shipyard.harness.workspace import Workspace
from shipyard.models.errors import InfraError
from shipyard.search.embed import BUNDLED_EMBEDDER, Embedder, SentenceEmbedder
from shipyard.search.index import CodeIndex, Hit, IndexConfig, IndexError_, UpdateReport
from shipyard.search.tree import LocalTree, Stamp, indexable_data

MAX_WORKSPACE_FILES = 50_000
TASK_INDEX = "search-index"  # a task's index, beside its snapshot (never inside it: the agent must not see it)
_embedders: dict[tuple[str, str], Embedder] = {}
_embedders_lock = threading.Lock()


def shared_embedder(name: str = BUNDLED_EMBEDDER, device: str = "cpu") -> Embedder:
    """One embedder per (model, device) in this process, shared by every episode's searcher."""
    with _embedders_lock:
        if (name, device) not in _embedders:
            _embedders[(name, device)] = SentenceEmbedder(name, device=device)
        return _embedders[(name, device)]


def _unquote(name: str) -> str:
    """A path as git prints it: as is, or C-quoted ("a/we\\"ird.py", octal escapes for bytes)."""
    if not (len(name) >= 2 and name[0] == name[-1] == '"'):
        return name
    raw = name[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    return raw.encode("latin-1", "replace").decode("utf-8", "surrogateescape")


_HEADER = re.compile(r'^diff --git (?:a/(.+) b/\1|("a/(?:[^"\\]|\\.)*") ("b/(?:[^"\\]|\\.)*"))$', re.MULTILINE)
_RENAME = re.compile(r"^(?:rename|copy) (from|to) (.+)$", re.MULTILINE)  # tree_diff's: "from a/x", "to b/y"
_NOTE = re.compile(r'^#   ("(?:[^"\\]|\\.)*"):', re.MULTILINE)


def diff_paths(patch: str) -> set[str]:
    """The files a workspace's `diff()` names: changed, added and removed (`diff --git` headers, quoted or not), both
    names of a rename or copy, and the files the patch's leading note left out (over the size limit, cut)."""
    out = set()
    for plain, quoted_a, quoted_b in _HEADER.findall(patch):
        out |= {plain} if plain else {_unquote(quoted_a)[2:], _unquote(quoted_b)[2:]}
    for side, name in _RENAME.findall(patch):
        name = _unquote(name)
        out.add(name.removeprefix("a/" if side == "from" else "b/"))
    for name in _NOTE.findall(patch):
        try:
            out.add(json.loads(name))
        except json.JSONDecodeError:
            continue
    return {p for p in out if p}


class WorkspaceFiles:
    """A workspace as a `FileSource` (stamps unknown: every listed file is read once, for a first build)."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace

    def files(self) -> dict[str, Stamp]:
        return {path: Stamp(-1, -1) for path in self.workspace.files(MAX_WORKSPACE_FILES)}

    def read(self, path: str) -> bytes | None:
        try:
            data = self.workspace.read_bytes(path)
        except InfraError:
            raise
        except (OSError, ValueError):  # gone, not a regular file, too large (PathError is an OSError or ValueError)
            return None
        return indexable_data(data)


def copy_index(base: Path, dest: Path) -> None:
    """A private copy of the index in `base`: hard links for its files (replaced, never rewritten, by their writers),
    copies where a link cannot be made; Tantivy's lock files are left for the copy to make its own, and anything but a
    directory or a regular file (a link planted in a tampered index) is not copied."""
    for src in base.rglob("*"):
        rel = src.relative_to(base)
        target = dest / rel
        mode = src.lstat().st_mode
        if stat.S_ISDIR(mode):
            target.mkdir(parents=True, exist_ok=True)
            continue
        if not stat.S_ISREG(mode) or src.name.startswith(".tantivy-"):
            continue  # a link (a tampered index) or a lock: not copied
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, target)
        except OSError:
            shutil.copy2(src, target)


class IndexSearcher:
    """`codebase_search`'s backend for one episode (see the module docstring). Thread-safe; `close()` removes the
    private copy."""

    def __init__(self, embedder: Embedder, base: Path | None = None, config: IndexConfig | None = None):
        self.embedder = embedder
        self.base = base
        self.config = config
        self.index: CodeIndex | None = None
        self.scratch: Path | None = None
        self.pending: set[str] = set()  # files written since the last refresh
        self.any_file = False  # a terminal command ran: from now on the workspace's diff says what changed
        self.refreshed: set[str] = set()  # every file refreshed so far (a revert must be seen too)
        self.lock = threading.Lock()

    def wrote(self, paths: set[str] | None) -> None:
        with self.lock:
            if paths is None:
                self.any_file = True  # sticky: a command may leave a process behind that writes later
            else:
                self.pending |= paths

    def search(self, workspace: Workspace, query: str, directories: list[str] | None, k: int) -> list[SearchResult]:
        try:
            with self.lock:
                hits = self._search(workspace, query, directories, k)
        except (InfraError, PathError):
            raise
        except Exception as e:  # the index or the embedder failed: not the model's doing
            raise InfraError(f"code search failed: {type(e).__name__}: {e}") from e
        return [SearchResult(h.chunk.path, h.chunk.start, h.chunk.end, h.chunk.symbol, h.chunk.text) for h in hits]

    def _search(self, workspace: Workspace, query: str, directories: list[str] | None, k: int) -> list[Hit]:
        if self.index is None:
            self.index = self._open(workspace)
        paths = self.pending | (diff_paths(workspace.diff()) | self.refreshed if self.any_file else set())
        if paths:
            self.index.update(WorkspaceFiles(workspace), paths=sorted(paths))
            self.refreshed |= paths
        self.pending = set()
        return self.index.search(query, k, dirs=directories)

    def _open(self, workspace: Workspace) -> CodeIndex:
        """A private copy of the task's index; or, without one (or one made with another embedder), an index of the
        workspace's files built now."""
        self.scratch = Path(tempfile.mkdtemp(prefix="shipyard-search-"))
        if self.base is not None:
            copy_index(self.base, self.scratch / "index")
            try:
                return CodeIndex.open(self.scratch / "index", self.embedder, self.config)
            except IndexError_:
                shutil.rmtree(self.scratch / "index")
        index = CodeIndex.open(self.scratch / "index", self.embedder, self.config)
        index.update(WorkspaceFiles(workspace))
        self.pending = set()  # the build read the workspace as it is now
        return index

    def close(self) -> None:
        with self.lock:
            if self.index is not None:
                self.index.close()
                self.index = None
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
                self.scratch = None


def task_index(task_dir: Path) -> Path | None:
    """The index synthesis built for a task, or None (an older task set: the episode builds one on first use)."""
    path = Path(task_dir) / TASK_INDEX
    return path if (path / "index.json").is_file() else None


def repo_index_dir(repo: Path) -> Path:
    """Where this user's index of `repo` lives: `$SHIPYARD_HOME/search/<name>-<hash of its real path>`."""
    from shipyard.models.bundled import shipyard_home

    real = Path(repo).resolve()
    home = shipyard_home() / "search"
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home, 0o700)
    return home / f"{real.name}-{hashlib.sha256(str(real).encode()).hexdigest()[:16]}"


def open_repo_index(repo: Path, embedder: Embedder, index_dir: Path | None = None,
                    progress: Callable[[int, int], None] | None = None) -> tuple[CodeIndex, UpdateReport]:
    """This user's index of `repo` (`repo_index_dir`, or `index_dir`), brought up to date and saved; what changed."""
    index = CodeIndex.open(index_dir or repo_index_dir(repo), embedder)
    report = index.update(LocalTree(repo), progress=progress)
    index.save()
    return index, report


def index_tasks(base: Path, task_dirs: list[Path], embedder: Embedder, work: Path,
                log: Callable[[str], None] = lambda _: None) -> None:
    """Give each task its index (`TASK_INDEX`, beside its snapshot): the repository `base` is embedded once, then each
    task's copy refreshes the files its deletion changed and is compacted — nothing of the deleted code (text,
    vector or BM25 term) is left in a task's index."""
    base_index = CodeIndex.open(work / "search-base", embedder)
    report = base_index.update(LocalTree(base))
    base_index.save()
    base_index.close()
    log(f"search index of the repository: {base_index.live_chunks()} chunks ({report.seconds:.1f} s)")
    for task_dir in task_dirs:
        staging = task_dir / f".{TASK_INDEX}"
        shutil.rmtree(staging, ignore_errors=True)
        copy_index(work / "search-base", staging)
        index = CodeIndex.open(staging, embedder)
        report = index.update(LocalTree(task_dir / "snapshot"))
        index.compact()
        index.save()
        index.close()
        shutil.rmtree(task_dir / TASK_INDEX, ignore_errors=True)
        staging.rename(task_dir / TASK_INDEX)
        log(f"  search index of {task_dir.name}: {len(report.files_changed)} files re-embedded")
