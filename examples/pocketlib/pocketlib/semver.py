"""Semantic versions (https://semver.org): parsing, ordering, bumping and simple constraints."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

_PATTERN = re.compile(
    r"^(?P<major>0|[1-9]\d*)\.(?P<minor>0|[1-9]\d*)\.(?P<patch>0|[1-9]\d*)"
    r"(?:-(?P<pre>[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+(?P<build>[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


@total_ordering
@dataclass(frozen=True)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def _key(self):
        # A version without a pre-release sorts after every pre-release of the same core version.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, not self.prerelease, pre)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other: Version) -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def bump(self, part: str) -> Version:
        """Return the next version: ``part`` is 'major', 'minor' or 'patch'."""
        if part == "major":
            return Version(self.major + 1, 0, 0)
        if part == "minor":
            return Version(self.major, self.minor + 1, 0)
        if part == "patch":
            return Version(self.major, self.minor, self.patch + 1)
        raise ValueError(f"unknown version part: {part!r}")


def parse(text: str) -> Version:
    """Parse a semantic version string such as '1.4.2-rc.1+build.7'."""
    match = _PATTERN.match(text.strip())
    if match is None:
        raise ValueError(f"not a semantic version: {text!r}")
    pre = tuple(match["pre"].split(".")) if match["pre"] else ()
    build = tuple(match["build"].split(".")) if match["build"] else ()
    return Version(int(match["major"]), int(match["minor"]), int(match["patch"]), pre, build)


_OPS = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def satisfies(version: str | Version, constraint: str) -> bool:
    """Check a version against comma-separated constraints, e.g. '>=1.2.0, <2.0.0'."""
    v = parse(version) if isinstance(version, str) else version
    for clause in constraint.split(","):
        clause = clause.strip()
        for op in (">=", "<=", "==", "!=", ">", "<"):
            if clause.startswith(op):
                if not _OPS[op](v, parse(clause[len(op):])):
                    return False
                break
        else:
            raise ValueError(f"bad constraint clause: {clause!r}")
    return True


def max_satisfying(versions: list[str], constraint: str) -> str | None:
    """The highest version in ``versions`` that satisfies ``constraint``, or None."""
    matching = [parse(v) for v in versions if satisfies(v, constraint)]
    return str(max(matching)) if matching else None
