"""What `scripts/train_tiny.py prepare` does to the training split's text (held-out text is never
changed, so bits per byte stay comparable with earlier corpora).

`summary_docstrings` cuts each docstring to its first paragraph. Why: the greedy check continues six
prompts for 96 tokens and asks for valid Python. Trained on the standard library and site-packages,
whose docstrings run to dozens of lines (numpy's "Parameters / ----------" sections), the model
opened a docstring and was still inside it 96 tokens later in 3 of 6 prompts (run 5). Cut to their
summaries, docstrings close within a few lines, as PEP 257's one-line form does (run 6: 1 of 12).

`definition_documents` splits a file into documents at its top-level definitions: the lines before
the first `def` or `class` (imports, constants), then each top-level definition with its decorators
and what follows it up to the next one. Each document ends with <eos> in the token stream. Why: the
greedy check judges the whole text when the model ends it with <eos>, and otherwise cuts at the last
complete line, which fails when that line opens a block whose body the 96 tokens cut off (3 of run
6's 7 failures). A model that has seen a definition end with <eos> can end one.
"""

from __future__ import annotations

import ast
import itertools
import re

_BLANK_LINE = re.compile(rb"\n[ \t]*\n")
_TOP_LEVEL_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_DEFINITIONS = (ast.Module, *_TOP_LEVEL_DEFINITIONS)  # what can open with a docstring


def summary_docstrings(source: bytes) -> bytes:
    """`source` with every module, class and function docstring cut to its first paragraph.

    Docstrings that are one paragraph, not triple-quoted, or joined from several literals stay as they
    are; so does a file that does not parse, or would not parse after the cut."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source
    line_starts = _line_starts(source)
    spans = []
    for node in ast.walk(tree):
        literal = _docstring_literal(node)
        if literal is not None:
            start = line_starts[literal.lineno - 1] + literal.col_offset
            end = line_starts[literal.end_lineno - 1] + literal.end_col_offset
            indent = source[line_starts[literal.lineno - 1] : start]
            spans.append((start, end, indent))
    out = source
    for start, end, indent in sorted(spans, reverse=True):  # from the end, so earlier offsets stay valid
        cut = _first_paragraph(out[start:end], indent)
        if cut is not None:
            out = out[:start] + cut + out[end:]
    try:
        ast.parse(out)
    except (SyntaxError, ValueError):
        return source
    return out


def _docstring_literal(node: ast.AST) -> ast.Constant | None:
    if not isinstance(node, _DEFINITIONS) or not node.body:
        return None
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.value
    return None


def _line_starts(source: bytes) -> list[int]:
    """Byte offset of each line's start (ast's col_offset counts UTF-8 bytes)."""
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _first_paragraph(literal: bytes, indent: bytes) -> bytes | None:
    """The triple-quoted `literal` cut before its first blank line; None where it stays as it is."""
    opening = re.match(rb"[rRuU]?(\"\"\"|''')", literal)
    if opening is None:
        return None
    quote = opening.group(1)
    head, body = literal[: opening.end()], literal[opening.end() :]
    if not body.endswith(quote) or quote in body[: -len(quote)]:
        return None  # joined from several literals
    blank = _BLANK_LINE.search(body[: -len(quote)])
    if blank is None:
        return None  # one paragraph already
    summary = body[: blank.start()].rstrip()
    if not summary.strip() or summary.endswith((quote[:1], b"\\")):
        return None
    closing = b"\n" + (indent if indent.isspace() else b"") + quote if b"\n" in summary else quote
    return head + summary + closing


def definition_documents(source: bytes) -> list[bytes]:
    """`source` split before each top-level `def` and `class` (at its first decorator); a file that
    does not parse, or has no definition past its first line, stays one document. Joined, the
    documents are `source` again."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [source]
    starts = sorted({_first_line(node) for node in tree.body if isinstance(node, _TOP_LEVEL_DEFINITIONS)} - {1})
    line_starts = _line_starts(source)
    cuts = [0, *(line_starts[line - 1] for line in starts), len(source)]
    return [source[a:b] for a, b in itertools.pairwise(cuts) if a < b]


def _first_line(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])
