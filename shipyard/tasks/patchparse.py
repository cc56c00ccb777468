"""Reading a patch the way `git apply` reads it: which files each section touches, its mode, its added lines.

A reward is only as good as the patch reading behind it: a path check that understands `diff --git a/x b/x` but
not `diff --git "a/x" "b/x"` (git quotes names with unusual bytes), nor a plain `--- a/x` / `+++ b/x` diff without
a git header, nor `rename to`, waves those files through while `git apply` happily writes them. `parse_patch`
follows git's `apply.c` step by step: quoted C-style names, `-p1` stripping (and git's `-p0` guess from a first
plain diff without prefixes), `/dev/null`, GNU timestamps and epoch creations, `---`/`+++` names overriding the
`diff --git` line, extended headers (an unknown line ends them), names a header-less `diff --git` line leaves to
the next section, binary patches; it splits lines at `\n` only and walks hunks by their line counts, so an added
line that looks like a header cannot be mistaken for one. A patch git refuses as a whole comes back with a
`problem` on its last section.

The patch is untrusted and up to 8 MiB, so the reading is linear in it and raises nothing: the GNU timestamp is
matched from its date, not from every space before it (review A6: a `---` name followed by 40 KB of spaces took
~100 s), a `diff --git` line's two names are compared at the one split point that can work, and hunk counts
saturate as git's strtoul does (Python refuses to convert more than 4,300 digits).

tests/tasks/test_patchscan.py holds it to `git apply --numstat`, `--summary` and `--check -v` on real `git diff`
output, hostile and random patches. The grader does not trust this parser alone: it asks `git apply --numstat`
for the same list in the sandbox and rejects a patch on which the two disagree. What a parsed patch may touch, and
what its added code reaches for, is `shipyard.tasks.patchscan`.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

_C_SPACE = " \t\n\v\f\r"  # C's isspace(), which git's name parsing uses
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_LINES = re.compile(r"[^\n]*\n|[^\n]+\Z")
_HUNK = re.compile(r"@@ -([0-9]+)(?:,([0-9]+))? \+([0-9]+)(?:,([0-9]+))? @@")
# GNU diff's timestamp after a traditional `---`/`+++` name (git's diff_timestamp_len), stripped before the name:
# a date that ends the line but for a time and a zone. The whitespace before it is counted by `_stamp_start`, not
# here: a search that began with ` +` would try every space of a long run as a start, each time to the end.
_STAMP = re.compile(r"(?:[0-9]{2})?[0-9]{2}-[0-9]{2}-[0-9]{2}(?: [0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?)?"
                    r"(?: [+-][0-9]{4}| [+-][0-9]{2}:[0-9]{2})?\Z")
_EPOCH = re.compile(r"(1969-12-31|1970-01-01) ([0-2][0-9]):([0-5][0-9]):00(?:\.0+)? ([-+])([0-2][0-9]):?([0-5][0-9])\n")
_BINARY_DATA = re.compile(r"(?:literal|delta) [0-9]+\n|[A-Za-z][0-9A-Za-z!#$%&()*+;<=>?@^_`{|}~-]+\n")
_GIT_KEYS = ("@@ -", "--- ", "+++ ", "old mode ", "new mode ", "deleted file mode ", "new file mode ", "copy from ",
             "copy to ", "rename old ", "rename new ", "rename from ", "rename to ", "similarity index ",
             "dissimilarity index ", "index ")
TERM_SPACE, TERM_TAB = 1, 2



@dataclass
class FileChange:
    """One file section of a patch; `old`/`new` are paths with the prefix stripped, None for /dev/null."""

    old: str | None = None
    new: str | None = None
    mode: str | None = None  # the mode the file ends with, when the patch states one
    binary: bool = False
    added: list[str] = field(default_factory=list)  # added lines, without the leading "+"
    problem: str | None = None  # why `git apply` refuses the patch here (parsing stopped at this section)

    @property
    def paths(self) -> list[str]:
        return sorted({p for p in (self.old, self.new) if p})


class _Malformed(Exception):
    """The patch is one `git apply` refuses as a whole: why, and the index of the line."""

    def __init__(self, why: str, at: int) -> None:
        super().__init__(f"{why} at line {at + 1}")


def _unquote_c(text: str) -> tuple[str, int] | None:
    """git's unquote_c_style on `text` (which starts with a double quote): the name and the index after the closing
    quote, or None when the quoting is broken (an unknown escape, no closing quote on the line)."""
    raw, i = bytearray(), 1
    while i < len(text):
        c = text[i]
        if c == '"':
            return raw.decode(errors="surrogateescape"), i + 1
        if c == "\n":
            return None
        if c != "\\":
            raw += c.encode(errors="surrogatepass")
            i += 1
            continue
        nxt = text[i + 1:i + 2]
        if nxt in _ESCAPES:
            raw.append(_ESCAPES[nxt])
            i += 2
        elif nxt and nxt in "0123" and re.fullmatch("[0-7]{2}", text[i + 2:i + 4]):
            raw.append(int(text[i + 1:i + 4], 8))
            i += 4
        else:
            return None
    return None


def unquote(name: str) -> str:
    """A name as git writes it: bare, or double-quoted with C escapes (octal bytes for non-ASCII)."""
    got = _unquote_c(name) if name.startswith('"') else None
    return got[0] if got else name


def _squash(name: str | None) -> str | None:
    return re.sub("/{2,}", "/", name) if name is not None else None


def _skip_prefix(name: str, p: int) -> str | None:
    """`name` without its first `p` components (git's skip_tree_prefix); None when it has too few or is absolute."""
    if p == 0:
        return None if name.startswith("/") else name
    for i, ch in enumerate(name):
        if ch == "/":
            p -= 1
            if p <= 0:
                return None if i == 0 else name[i + 1:]
    return None


def _terminates(c: str, terminate: int) -> bool:
    """git's name_terminate for a whitespace character: a space or tab ends a name only when asked to."""
    return not ((c == " " and not terminate & TERM_SPACE) or (c == "\t" and not terminate & TERM_TAB))


def _name_common(line: str, default: str | None, p: int, end: int | None, terminate: int) -> str | None:
    """git's find_name_common: the name at the start of `line` less `p` components, `default` when there is none
    or when `default` is a prefix of it (`file.orig`)."""
    start, i = (0 if p == 0 else None), 0
    while i < (len(line) if end is None else end):
        c = line[i]
        if end is None and c in _C_SPACE and _terminates(c, terminate):
            break
        i += 1
        if c == "/":
            p -= 1
            if p == 0:
                start = i
    if start is None or i == start:
        return _squash(default)
    name = line[start:i]
    if default is not None and len(default) < len(name) and name.startswith(default):
        return _squash(default)
    return _squash(name)


def _name_gnu(line: str, p: int) -> str | None:
    got = _unquote_c(line)
    if got is None:
        return None
    name = got[0]
    for _ in range(p):
        if "/" not in name:
            return None
        name = name.split("/", 1)[1]
    return _squash(name)


def _find_name(line: str, default: str | None, p: int, terminate: int) -> str | None:
    if line.startswith('"'):
        name = _name_gnu(line, p)
        if name is not None:
            return name
    return _name_common(line, default, p, None, terminate)


def _name_traditional(line: str, default: str | None, p: int) -> str | None:
    if line.startswith('"'):
        name = _name_gnu(line, p)
        if name is not None:
            return name
    stamp = _stamp_start(line.split("\n", 1)[0])
    if stamp is None:
        return _name_common(line, default, p, None, TERM_TAB)
    return _name_common(line, default, p, stamp, 0)


def _stamp_start(text: str) -> int | None:
    """Where the timestamp after a traditional name begins (at the one tab or the run of spaces before its date),
    None when `text` does not end with one."""
    m = _STAMP.search(text)
    if not m or not m.start():
        return None
    if text[m.start() - 1] == "\t":
        return m.start() - 1
    start = len(text[:m.start()].rstrip(" "))
    return start if start < m.start() else None


def _is_dev_null(name: str) -> bool:
    return name.startswith("/dev/null") and name[9:10] != "" and name[9] in _C_SPACE


def _is_epoch(line: str) -> bool:
    """GNU diff's epoch timestamp after the last tab: the file is created (on `---`) or deleted (on `+++`)."""
    head = line.split("\n", 1)[0]
    m = _EPOCH.match(line[head.rindex("\t") + 1:]) if "\t" in head else None
    if not m:
        return False
    zone = (int(m.group(5)) * 60 + int(m.group(6))) * (-1 if m.group(4) == "-" else 1)
    return int(m.group(2)) * 60 + int(m.group(3)) - zone == (24 * 60 if m.group(1) == "1969-12-31" else 0)


def _git_header_name(rest: str, p: int) -> str | None:
    """The name a `diff --git` line gives when both sides agree (git's git_header_name), else None."""
    if rest.startswith('"'):
        got = _unquote_c(rest)
        first = _skip_prefix(got[0], p) if got else None
        if got is None or first is None:
            return None
        j = got[1]
        while j < len(rest) and rest[j] in _C_SPACE:
            j += 1
        if j >= len(rest):
            return None
        if rest[j] == '"':
            second = _unquote_c(rest[j:])
            other = _skip_prefix(second[0], p) if second else None
        else:
            other = _skip_prefix(rest[j:], p)
        return first if other == first else None
    name = _skip_prefix(rest, p)
    if name is None:
        return None
    if '"' in name:
        got = _unquote_c(name[name.index('"'):])
        other = _skip_prefix(got[0], p) if got else None
        ok = other is not None and len(other) < name.index('"') and name.startswith(other)
        return other if ok and name[len(other)] in _C_SPACE else None
    if "\n" not in name:
        return None
    line = name[:name.index("\n")]
    # The name, a space or tab, and the same name again with its prefix: as the split point moves right, where the
    # second name begins never moves left, so at most one split gives two names of the same length; only that one
    # is compared (slicing the rest of the line at every space would be quadratic in a line of spaces).
    slashes = [k for k, ch in enumerate(line) if ch == "/"]
    for k, ch in enumerate(line):
        if ch in " \t":
            begin = _prefix_end(line, k + 1, p, slashes)
            if begin is not None and len(line) - begin == k and line[:k] == line[begin:]:
                return line[:k]
    return None


def _prefix_end(line: str, begin: int, p: int, slashes: list[int]) -> int | None:
    """Where `_skip_prefix(line[begin:], p)` begins in `line` (None where it gives None); `slashes` are the indexes
    of every `/` in `line`."""
    if p == 0:
        return None if line.startswith("/", begin) else begin
    i = bisect.bisect_left(slashes, begin) + p - 1
    if i >= len(slashes) or slashes[i] == begin:
        return None
    return slashes[i] + 1


def _mode(text: str, at: int) -> int:
    m = re.match(r"[ \t\v\f\r]*[+-]?([0-7]+)(?=[ \t\n\v\f\r])", text)
    if not m:
        raise _Malformed(f"invalid mode {text.strip()[:40]!r}", at)
    return int(m.group(1), 8)


@dataclass
class _Section:
    change: FileChange
    is_new: bool = False
    is_delete: bool = False


def _git_header(lines: list[str], j: int, p: int, carry: tuple[str | None, str | None]) -> tuple[int, _Section]:
    """The extended header after `diff --git` at line `j` (git's parse_git_diff_header): end index and section.
    `carry` holds the names a skipped `diff --git` line before it left behind: git keeps them."""
    default = _git_header_name(lines[j][len("diff --git "):], p)
    s, old_mode, new_mode, kinds = _Section(FileChange(*carry)), None, None, set()
    c = s.change
    k = j + 1
    while k < len(lines) and lines[k].endswith("\n"):
        line = lines[k]
        key = next((key for key in _GIT_KEYS if line.startswith(key)), "")
        rest = line[len(key):]
        if key in ("", "@@ -"):
            break
        if key in ("--- ", "+++ "):
            side = "old" if key == "--- " else "new"
            isnull = s.is_new if side == "old" else s.is_delete
            have = getattr(c, side)
            if have is None and not isnull:
                setattr(c, side, _find_name(rest, None, p, TERM_TAB))
            elif have is not None and (isnull or _find_name(rest, None, p, TERM_TAB) != have):
                raise _Malformed(f"inconsistent {side} filename", k)
            elif have is None and not _is_dev_null(rest):
                raise _Malformed("expected /dev/null", k)
        elif key == "old mode ":
            old_mode = _mode(rest, k)
        elif key == "new mode ":
            new_mode = _mode(rest, k)
        elif key == "deleted file mode ":
            s.is_delete, c.old, old_mode = True, default, _mode(rest, k)
            kinds.add("delete")
        elif key == "new file mode ":
            s.is_new, c.new, new_mode = True, default, _mode(rest, k)
            kinds.add("new")
        elif key.startswith(("copy ", "rename ")):
            name = _find_name(rest, None, max(p - 1, 0), 0)
            setattr(c, "old" if key.endswith(("from ", "old ")) else "new", name)
            kinds.add(key.split()[0])
        elif key == "index ":
            m = re.match(r"[^.\n]{0,64}\.\.([^ \n]*)", rest)
            if m and len(m.group(1)) <= 64 and rest[m.end():m.end() + 1] == " ":
                old_mode = _mode(rest[m.end() + 1:], k)
        if len(kinds) > 1:
            raise _Malformed("inconsistent header lines", k)
        k += 1
    if c.old is None and c.new is None:
        if default is None:
            raise _Malformed("git diff header lacks filename information", j)
        c.old = c.new = default
    if (c.new is None and not s.is_delete) or (c.old is None and not s.is_new):
        raise _Malformed("git diff header lacks filename information", j)
    mode = None if s.is_delete else (new_mode if new_mode is not None else old_mode)
    c.mode = format(mode, "o") if mode is not None else None
    return k, s


def _traditional(first: str, second: str, state: dict, at: int, carry: tuple[str | None, str | None]) -> _Section:
    """A `---`/`+++` pair without a git header (git's parse_traditional_patch), guessing -p0 as git does; a creation
    or deletion keeps the other name from `carry`, as git does."""
    if not state["p_known"]:
        def guess(name: str) -> int:
            full = None if _is_dev_null(name) else _name_traditional(name, None, 0)
            return -1 if full is None or "/" in full else 0
        p, q = guess(first), guess(second)
        p = q if p < 0 else p
        if 0 <= p == q:
            state["p"], state["p_known"] = p, True
    p = state["p"]
    if _is_dev_null(first):
        name = _name_traditional(second, None, p)
        s = _Section(FileChange(carry[0], name), is_new=True)
    elif _is_dev_null(second):
        name = _name_traditional(first, None, p)
        s = _Section(FileChange(name, carry[1]), is_delete=True)
    else:
        name = _name_traditional(second, _name_traditional(first, None, p), p)
        if _is_epoch(first):
            s = _Section(FileChange(carry[0], name), is_new=True)
        elif _is_epoch(second):
            s = _Section(FileChange(name, carry[1]), is_delete=True)
        else:
            s = _Section(FileChange(name, name))
    if name is None:
        raise _Malformed("unable to find a file name in a ---/+++ header", at)
    return s


def _count(digits: str) -> int:
    """A hunk's line count as git's strtoul reads it: saturating instead of converting thousands of digits (which
    Python refuses past 4300: a ValueError out of the parser)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 20 else 1 << 64


def _fragment(lines: list[str], k: int, sizes: list[int], change: FileChange) -> tuple[int, int, int]:
    """One hunk at line `k` walked by its line counts (git's parse_fragment): next index, old and new counts."""
    m = _HUNK.match(lines[k])
    if not m or not lines[k].endswith("\n"):
        raise _Malformed("corrupt hunk header", k)
    old = _count(m.group(2)) if m.group(2) is not None else 1
    new = _count(m.group(4)) if m.group(4) is not None else 1
    old_total, new_total, changed = old, new, 0
    k += 1
    while k < len(lines) and (old or new):
        line = lines[k]
        tag = line[:1]
        if not line.endswith("\n"):
            raise _Malformed("corrupt hunk (a line without its newline)", k)
        if tag in ("\n", " "):
            old, new = old - 1, new - 1
        elif tag == "-":
            old, changed = old - 1, changed + 1
        elif tag == "+":
            new, changed = new - 1, changed + 1
            change.added.append(line[1:-1])
        elif tag != "\\" or len(line) < 12 or not line.startswith("\\ "):
            raise _Malformed("corrupt hunk (a line that is not context, added or removed)", k)
        if old < 0 or new < 0:
            raise _Malformed("corrupt hunk (more lines than its header counts)", k)
        k += 1
    if old or new or not changed:
        raise _Malformed("corrupt hunk (fewer lines than its header counts, or no change)", k)
    if k < len(lines) and lines[k].startswith("\\ ") and sizes[k] > 12:
        k += 1  # "\ No newline at end of file" after the last counted line
    return k, old_total, new_total


def _find_header(lines: list[str], i: int, sizes: list[int], state: dict) -> tuple[int, _Section] | None:
    """The next file header at or after line `i` (git's find_header): index of its first hunk line and section."""
    carry: tuple[str | None, str | None] = (None, None)
    for j in range(i, len(lines)):
        line = lines[j]
        if sizes[j] - sizes[j + 1] < 6:
            continue
        if line.startswith("@@ -"):
            if _HUNK.match(line) and line.endswith("\n"):
                raise _Malformed("a hunk without a file header", j)
            continue
        if sizes[j + 1] < 6:
            return None
        if line.startswith("diff --git "):
            end, s = _git_header(lines, j, state["p"], carry)
            if end > j + 1:
                return end, s
            carry = (s.change.old, s.change.new)  # a `diff --git` line with no header after it names the next one
            continue
        if (line.startswith("--- ") and j + 2 < len(lines) and lines[j + 1].startswith("+++ ")
                and lines[j + 2].startswith("@@ -") and sizes[j] >= sizes[j + 1] - sizes[j + 2] + 14):
            return j + 2, _traditional(line[4:], lines[j + 1][4:], state, j, carry)
    return None


def parse_patch(patch: str) -> list[FileChange]:
    """Every file section of `patch`, in order, as `git apply` reads it (text between sections is ignored); when git
    would refuse the patch, the last section carries the `problem` and parsing stops there."""
    lines = _LINES.findall(patch)
    sizes = [0] * (len(lines) + 1)  # bytes from line i to the end, for git's look-ahead limits
    for n in range(len(lines) - 1, -1, -1):
        sizes[n] = sizes[n + 1] + len(lines[n].encode(errors="surrogatepass"))
    changes: list[FileChange] = []
    state = {"p": 1, "p_known": False}
    i = 0
    while i < len(lines):
        try:
            found = _find_header(lines, i, sizes, state)
            if found is None:
                break
            i, s = found
            old_lines = new_lines = hunks = 0
            while i < len(lines) and lines[i].startswith("@@ -") and sizes[i] > 4:
                i, o, n = _fragment(lines, i, sizes, s.change)
                old_lines, new_lines, hunks = old_lines + o, new_lines + n, hunks + 1
            if (s.is_new and old_lines) or (s.is_delete and new_lines):
                raise _Malformed("a new file with old contents or a deleted file with new contents", i - 1)
            if not hunks and i < len(lines):
                i = _binary(lines, i, s.change)
            changes.append(s.change)
        except _Malformed as e:
            changes.append(FileChange(problem=str(e)))
            break
    return changes


def _binary(lines: list[str], i: int, change: FileChange) -> int:
    """A binary section's body after its header (`GIT binary patch` hunks, or `Binary files … differ`)."""
    line = lines[i]
    if line == "GIT binary patch\n":
        change.binary = True
        i += 1
        while i < len(lines) and (_BINARY_DATA.fullmatch(lines[i]) or lines[i] == "\n"):
            i += 1
    elif line.endswith(" differ\n") and line.startswith(("Binary files ", "Files ")):
        change.binary = True
        i += 1
    return i
