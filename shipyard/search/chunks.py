"""Code split into search units along its syntax: each function, method or class that fits the embedder becomes one
chunk; what does not fit is split at its inner definitions, then into line windows; other files are line windows.

Why syntax: a retrieval unit that is a whole definition carries its name, signature and body together, so a query
about a behaviour lands on the code that implements it rather than on a window that starts half-way through one
(chunking along the abstract syntax tree beats fixed windows for code retrieval: Zhang et al. 2025, "cAST: Enhancing
Code Retrieval-Augmented Generation with Structural Chunking via Abstract Syntax Tree", arXiv:2506.15655). Why a
token cap: a sentence embedder reads a bounded number of tokens (MiniLM: 256 word pieces) and silently drops the
rest, so a chunk larger than that would be indexed by its first lines only.

The algorithm, over the tree-sitter parse of a file:

    emit(region, symbol):                      # region: a node's lines; symbol: the enclosing qualified name
        for each definition D directly inside region (not inside another definition):
            if tokens(D) <= cap:  one chunk of D's lines, symbol = symbol.D
            else:                 emit(D, symbol.D)         # its inner definitions, then its own remaining lines
        the lines of region outside those definitions → windows of <= cap tokens, symbol = symbol

Decorators, `export` and Rust/Go receivers stay with their definition. Token counts are per line (one batched call
to the embedder's tokenizer per file) and summed, so a file costs one tokenizer pass however it is cut. Lines are
1-based and inclusive (`path:start-end`, as `read_file` numbers them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import PurePosixPath

MAX_WINDOW_LINES = 60  # a window of short lines still ends here: a result the agent can read at a glance
MAX_CHUNK_CHARS = 8_000  # a minified line is indexed by its start; the chunk still names all its lines
MAX_DEPTH = 40  # definitions nested deeper are cut into line windows (a generated file must not exhaust the stack)

LineCounter = Callable[[Sequence[str]], list[int]]


@dataclass(frozen=True)
class Chunk:
    path: str  # relative to the indexed root, '/'-separated
    start: int  # first line, 1-based
    end: int  # last line, inclusive
    symbol: str | None  # the enclosing definition, qualified ("Stack.push"); None at module level
    text: str
    language: str | None  # the file's grammar; None for a file no grammar reads (cut into line windows only)

    @property
    def location(self) -> str:
        return f"{self.path}:{self.start}-{self.end}"


# Per language: the suffixes it reads, the node types that are definitions, and how a definition's name is found.
LANGUAGES: dict[str, tuple[str, ...]] = {
    "python": (".py", ".pyi"),
    "javascript": (".js", ".mjs", ".cjs", ".jsx"),
    "typescript": (".ts", ".mts", ".cts"),
    "tsx": (".tsx",),
    "go": (".go",),
    "rust": (".rs",),
}
_SCRIPT = frozenset({"function_declaration", "generator_function_declaration", "class_declaration",
                     "method_definition", "abstract_class_declaration", "interface_declaration",
                     "type_alias_declaration", "enum_declaration", "internal_module", "lexical_declaration",
                     "variable_declaration", "export_statement"})
DEFINITIONS: dict[str, frozenset[str]] = {
    "python": frozenset({"function_definition", "class_definition", "decorated_definition"}),
    "javascript": _SCRIPT, "typescript": _SCRIPT, "tsx": _SCRIPT,
    "go": frozenset({"function_declaration", "method_declaration", "type_declaration"}),
    "rust": frozenset({"function_item", "struct_item", "enum_item", "union_item", "trait_item", "impl_item",
                       "mod_item", "macro_definition", "const_item", "static_item", "type_item"}),
}
_FUNCTION_VALUES = frozenset({"arrow_function", "function_expression", "function", "generator_function",
                              "class", "class_expression"})


def language_of(path: str) -> str | None:
    suffix = PurePosixPath(path).suffix.lower()
    return next((name for name, suffixes in LANGUAGES.items() if suffix in suffixes), None)


@cache
def parser(language: str):
    """A tree-sitter parser for `language` (the grammar wheels from PyPI: nothing is downloaded at run time)."""
    import tree_sitter

    if language == "python":
        import tree_sitter_python as grammar
        lang = grammar.language()
    elif language == "javascript":
        import tree_sitter_javascript as grammar
        lang = grammar.language()
    elif language in ("typescript", "tsx"):
        import tree_sitter_typescript as grammar
        lang = grammar.language_typescript() if language == "typescript" else grammar.language_tsx()
    elif language == "go":
        import tree_sitter_go as grammar
        lang = grammar.language()
    elif language == "rust":
        import tree_sitter_rust as grammar
        lang = grammar.language()
    else:
        raise ValueError(f"no grammar for {language!r}; languages: {', '.join(LANGUAGES)}")
    return tree_sitter.Parser(tree_sitter.Language(lang))


def definition_name(node) -> str | None:
    """The name a definition node declares, or None when it is not one we index as a unit (a `const x = 1`)."""
    kind = node.type
    if kind in ("decorated_definition", "export_statement"):
        inner = node.child_by_field_name("definition") or node.child_by_field_name("declaration")
        return definition_name(inner) if inner is not None else None
    if kind in ("lexical_declaration", "variable_declaration"):  # const f = () => …; let C = class {…}
        for declarator in node.named_children:
            value = declarator.child_by_field_name("value")
            if declarator.type == "variable_declarator" and value is not None and value.type in _FUNCTION_VALUES:
                return _text(declarator.child_by_field_name("name"))
        return None
    if kind == "type_declaration":  # Go: type S struct {…}
        spec = next((c for c in node.named_children if c.type in ("type_spec", "type_alias")), None)
        return _text(spec.child_by_field_name("name")) if spec is not None else None
    if kind == "impl_item":  # Rust: impl Trait for Type — named by its type
        return _text(node.child_by_field_name("type"))
    if kind == "method_declaration":  # Go: func (s *Stack) Push() — Stack.Push
        receiver = node.child_by_field_name("receiver")
        names = re.findall(r"[A-Za-z_]\w*", _text(receiver) or "")
        own = _text(node.child_by_field_name("name"))
        return f"{names[-1]}.{own}" if names and own else own
    return _text(node.child_by_field_name("name"))


def _unwrap(node):
    """The definition a wrapper holds (`@decorator`, `export`, `const f = () => …`): what to look inside."""
    if node.type in ("decorated_definition", "export_statement"):
        inner = node.child_by_field_name("definition") or node.child_by_field_name("declaration")
        return _unwrap(inner) if inner is not None else node
    if node.type in ("lexical_declaration", "variable_declaration"):
        for declarator in node.named_children:
            value = declarator.child_by_field_name("value")
            if value is not None and value.type in _FUNCTION_VALUES:
                return value
    return node


def _text(node) -> str | None:
    return node.text.decode("utf-8", "replace") if node is not None and node.text is not None else None


def _definitions(node, definitions: frozenset[str]) -> list:
    """The definitions directly inside `node`: found in its descendants, not looking inside a definition."""
    found, stack = [], list(reversed(node.named_children))
    while stack:
        child = stack.pop()
        if child.type in definitions and definition_name(child) is not None:
            found.append(child)
        else:
            stack.extend(reversed(child.named_children))
    return found


def estimate_tokens(lines: Sequence[str]) -> list[int]:
    """A tokenizer-free count per line (words and punctuation marks): the default when no embedder counts."""
    return [len(re.findall(r"\w+|[^\w\s]", line)) for line in lines]


def chunk_file(path: str, text: str, max_tokens: int, count: LineCounter = estimate_tokens) -> list[Chunk]:
    """The chunks of one file's `text`, in line order; every non-blank line is in exactly one chunk. A file its
    grammar cannot take (nesting past the stack, an encoding the parser refuses) is cut into line windows."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    lines = text.split("\n")  # as tree-sitter counts rows (str.splitlines also splits at \f, \x1c, …)
    if not text.strip():
        return []
    tokens = count(lines)
    language = language_of(path)
    out: list[Chunk] = []

    def windows(first: int, last: int, symbol: str | None) -> None:  # 0-based rows, inclusive
        start, total = None, 0
        for row in range(first, last + 1):
            if start is None:
                if not lines[row].strip():
                    continue
                start, total = row, 0
            if row > start and (total + tokens[row] > max_tokens or row - start >= MAX_WINDOW_LINES):
                add(start, _last_content(lines, start, row - 1), symbol)
                start, total = (row, 0) if lines[row].strip() else (None, 0)
                if start is None:
                    continue
            total += tokens[row]
        if start is not None:
            add(start, _last_content(lines, start, last), symbol)

    def add(first: int, last: int, symbol: str | None) -> None:
        body = "\n".join(lines[first:last + 1])[:MAX_CHUNK_CHARS]
        out.append(Chunk(path, first + 1, last + 1, symbol, body, language))

    def emit(node, first: int, last: int, symbol: str | None, depth: int = 0) -> None:
        row = first
        for definition in _definitions(node, DEFINITIONS[language]) if depth < MAX_DEPTH else ():
            start, end = definition.start_point[0], definition.end_point[0]
            if start < row:  # two definitions on one line: the first one's chunk holds both
                continue
            windows(row, start - 1, symbol)
            name = definition_name(definition)
            qualified = f"{symbol}.{name}" if symbol else name
            if sum(tokens[start:end + 1]) <= max_tokens:
                add(start, end, qualified)
            else:
                emit(_unwrap(definition), start, end, qualified, depth + 1)
            row = end + 1
        windows(row, last, symbol)

    if language is not None:
        try:
            tree = parser(language).parse(text.encode("utf-8", "surrogatepass"))
            emit(tree.root_node, 0, len(lines) - 1, None)
            return sorted(out, key=lambda c: c.start)
        except (RecursionError, ValueError, UnicodeError):  # what a file's content can cause: windows instead
            out.clear()
    windows(0, len(lines) - 1, None)
    return out


def _last_content(lines: Sequence[str], first: int, last: int) -> int:
    while last > first and not lines[last].strip():
        last -= 1
    return last
