"""Scrubbing the agent-visible snapshot, and the leak scanner that proves the deleted code is gone from it.

Agents that got good enough found deleted code in leftovers: type-checker caches, bytecode, an installed copy in
site-packages, git history (Composer 2.5; SWE-bench Pro and commit0 agents reading `git log`). So the snapshot
an agent sees is scrubbed — build products and caches removed, history replaced by one fresh commit of the
post-deletion tree — and then *scanned*: fingerprints unique to the deleted code are searched across every byte
of the snapshot, its venv included, inside zip archives (wheels, eggs) and git objects (decompressed). One hit
rejects the task.

Fingerprints are the deleted code's identifiers (6+ characters), string literals (8+) and whitespace-normalized
lines (24+) that occur nowhere in what the agent may legitimately read: the project's remaining files and the
files the venv's third-party distributions own (by their `RECORD`). Any hit is therefore in something that is
neither, i.e. a leak. A task whose deleted code has no fingerprint at all is scanned vacuously; the count is
logged with the task.
"""

from __future__ import annotations

import builtins
import contextlib
import keyword
import re
import shutil
import subprocess
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

SCRUB_DIRS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".pytype", ".pyre", ".hypothesis",
              ".tox", ".nox", ".eggs", "htmlcov", "build", "dist", ".benchmarks", ".git", ".hg", ".svn",
              ".shipyard-run", ".coverage_html"}
SCRUB_DOC_BUILDS = ("docs/_build", "docs/build", "doc/_build", "doc/build")
SCRUB_FILES = re.compile(r"(\.pyc|\.pyo|\.orig|\.rej|\.egg-info|\.coverage(\..*)?|coverage\.xml|\.DS_Store)$")
IDENT = re.compile(rb"[A-Za-z_][A-Za-z0-9_]{5,}")
STRING = re.compile(r"""(?:'([^'\\\n]{8,})'|"([^"\\\n]{8,})")""")
COMMON = {w.encode() for w in (*keyword.kwlist, *dir(builtins))}


def scrub(root: Path, venv: str = ".venv") -> list[str]:
    """Remove caches, build products and VCS history from `root` (the venv's third-party bytecode stays)."""
    removed: list[str] = []
    for doc in SCRUB_DOC_BUILDS:
        if (root / doc).is_dir():
            shutil.rmtree(root / doc)
            removed.append(doc)
    stack = [root]
    while stack:
        d = stack.pop()
        for entry in list(d.iterdir()):
            rel = entry.relative_to(root).as_posix()
            if rel == venv:
                continue
            if entry.is_dir() and not entry.is_symlink():
                if entry.name in SCRUB_DIRS or entry.name.endswith(".egg-info"):
                    shutil.rmtree(entry)
                    removed.append(rel)
                else:
                    stack.append(entry)
            elif SCRUB_FILES.search(entry.name):
                entry.unlink()
                removed.append(rel)
    return sorted(removed)


def fresh_commit(root: Path, venv: str = ".venv") -> None:
    """Make `root` a git repository with a single commit of its current tree (the venv excluded)."""
    git = ["git", "-c", "user.name=shipyard", "-c", "user.email=tasks@shipyard.invalid",
           "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", "--template="], cwd=root, check=True)  # no sample hooks, no description
    (root / ".git" / "info").mkdir(exist_ok=True)
    (root / ".git" / "info" / "exclude").write_text(f"/{venv}/\n")
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "snapshot", "--no-verify"], cwd=root, check=True)


def third_party_files(venv: Path, own: str | None) -> list[Path]:
    """Files owned by the venv's distributions other than the project itself, by their RECORD."""
    from importlib import metadata

    files: list[Path] = []
    for site in venv.glob("lib/python*/site-packages"):
        for dist in metadata.distributions(path=[str(site)]):
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if own and name == own:
                continue
            files += [Path(str(dist.locate_file(f))) for f in dist.files or [] if f.parts[0] != ".."]
    return [f for f in files if f.is_file()]


def normalize(line: str) -> str:
    return " ".join(line.split())


@dataclass
class Fingerprints:
    identifiers: list[bytes]
    strings: list[bytes]
    lines: list[bytes]

    def all(self) -> list[bytes]:
        return [*self.identifiers, *self.strings, *self.lines]


def fingerprints(snippets: list[str], corpus: bytes) -> Fingerprints:
    """What is unique to the deleted code: nowhere in `corpus` (the legitimately visible bytes)."""
    text = "\n".join(snippets)
    idents = sorted({m for m in IDENT.findall(text.encode()) if m not in COMMON and m not in corpus})
    strings = sorted({(a or b).encode() for a, b in STRING.findall(text)} - {b""})
    strings = [s for s in strings if s not in corpus]
    normalized_corpus = b" ".join(corpus.split())
    lines = sorted({normalize(line).encode() for line in text.splitlines() if len(normalize(line)) >= 24})
    lines = [ln for ln in lines if ln not in normalized_corpus]
    return Fingerprints(idents, strings, lines)


def _blobs(path: Path):
    """The bytes of a file, plus what its compression hides: zip members, zlib-compressed git objects."""
    data = path.read_bytes()
    yield data
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as z:
                for name in z.namelist():
                    yield z.read(name)
        except (zipfile.BadZipFile, OSError, NotImplementedError):
            pass
    elif "/.git/objects/" in str(path) and data[:1] == b"x":
        with contextlib.suppress(zlib.error):
            yield zlib.decompress(data)


def scan(root: Path, fps: Fingerprints) -> list[tuple[str, str]]:
    """(file, fingerprint) for every fingerprint found anywhere under `root`, binaries and archives included."""
    hits: list[tuple[str, str]] = []
    needles = fps.all()
    if not needles:
        return hits
    pattern = re.compile(b"|".join(re.escape(n) for n in sorted(needles, key=len, reverse=True)))
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        for blob in _blobs(path):
            for candidate in (blob, b" ".join(blob.split())):
                m = pattern.search(candidate)
                if m:
                    hits.append((path.relative_to(root).as_posix(), m.group().decode(errors="replace")))
                    break
            else:
                continue
            break
    if (root / ".git").is_dir():  # packed objects: let git decompress them
        proc = subprocess.run(["git", "cat-file", "--batch-all-objects", "--batch"], cwd=root, capture_output=True)
        m = pattern.search(proc.stdout) or pattern.search(b" ".join(proc.stdout.split()))
        if m:
            hits.append((".git (objects)", m.group().decode(errors="replace")))
    return hits
