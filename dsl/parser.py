"""The `.omni` parser: source text to `ast.Pipeline`, every syntax error a `ParseError`.

This module owns the lark setup (the grammar itself is `omni.lark`), the transformer from
lark's tree to the dataclass AST with a `Span` on every node, and the translation of
lark's exceptions into compiler-style errors with hints. It checks syntax only: names,
kinds, types and duplicates are the build phase's business.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import NamedTuple

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedToken, VisitError
from lark.lexer import PatternStr

from omniflow.errors import ParseError, Span
from omniflow.ir.values import Param

from . import ast

__all__ = ["KEYWORDS", "MAX_NESTING", "parse", "parse_file"]

KEYWORDS = frozenset(
    {"pipeline", "model", "param", "stage", "input", "output", "map"}
    | {"colocate", "separate", "true", "false", "auto"}
)
# Bracket nesting beyond this is rejected before the (recursive) tree transform runs.
MAX_NESTING = 32

_GRAMMAR = Path(__file__).with_name("omni.lark")
_NESTING = {"LSQB": 1, "RSQB": -1}


class _NamesEverywhere:
    """A no-op post-lexer whose only job is to make the contextual lexer try NAME in every
    state: otherwise, where only a keyword may come, `pipelinex` lexes as `pipeline` + `x`."""

    always_accept = ("NAME",)

    def process(self, stream):
        return stream


@functools.cache
def _lark() -> Lark:
    return Lark(
        _GRAMMAR.read_text(encoding="utf-8"),
        parser="lalr",
        lexer="contextual",
        postlex=_NamesEverywhere(),
        propagate_positions=True,
        maybe_placeholders=True,
    )


def parse(text: str, path: str = "<string>") -> ast.Pipeline:
    """Parse one `.omni` program; any syntax error is raised as a ParseError, nothing else."""
    source = _Source(text, path)
    tree, tokens = _parse_tree(source)
    try:
        return _AstBuilder(source, tokens).transform(tree)
    except VisitError as e:
        raise e.orig_exc from None


def parse_file(path: str | Path) -> ast.Pipeline:
    """Read and parse a `.omni` file (UTF-8); unreadable files are ParseErrors too."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ParseError(f"cannot read '{path}': {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _not_utf8(data, e, str(path)) from None
    return parse(text, str(path))


class _Source:
    """The text being parsed, split into lines the way lark counts them."""

    def __init__(self, text: str, path: str):
        self.text = text
        self.path = path
        # Only '\n' ends a line for lark; str.splitlines() would also split at '\f' etc.
        self.lines = [line.removesuffix("\r") for line in text.split("\n")]

    def span(self, line: int, col: int, end_col: int | None = None) -> Span:
        """A span on one line, running to the end of that line when `end_col` is None."""
        text = self.lines[line - 1] if 1 <= line <= len(self.lines) else ""
        if end_col is None:
            end_col = len(text) + 1
        return Span(self.path, line, col, max(end_col, col + 1), text)

    def region(self, line: int, col: int, end_line: int, end_col: int) -> Span:
        """A region that may end on a later line, cut at the end of its first line."""
        return self.span(line, col, end_col if end_line == line else None)

    def token_span(self, token: Token) -> Span:
        return self.region(token.line, token.column, token.end_line, token.end_column)

    def meta_span(self, meta) -> Span:
        return self.region(meta.line, meta.column, meta.end_line, meta.end_column)


def _parse_tree(source: _Source):
    """Run the LALR parser token by token, keeping the tokens for spans and error hints."""
    parser = _lark().parse_interactive(source.text)
    tokens: list[Token] = []
    depth = 0
    try:
        for token in parser.iter_parse():
            tokens.append(token)
            depth += _NESTING.get(token.type, 0)
            if depth > MAX_NESTING:
                raise ParseError(
                    f"brackets nested more than {MAX_NESTING} deep",
                    source.token_span(token),
                    hint="flatten the value",
                )
        return parser.feed_eof(tokens[-1] if tokens else None), tokens
    except LarkError as e:
        # iter_parse yields a token before feeding it: one the parser refused is in `tokens`.
        if tokens and tokens[-1] is getattr(e, "token", None):
            tokens.pop()
        raise _syntax_error(e, source, tokens, parser.accepts) from None


class _Value(NamedTuple):
    """A parsed value with the span of its text (plain values carry no span of their own)."""

    value: ast.Value
    span: Span


class _Route(NamedTuple):
    """The `-> [map(...) ->] target [attrs]` part shared by flows and inputs."""

    maps: list[ast.MapOp]
    target: ast.PortRef | ast.OutputRef
    attrs: list[ast.Attr]


_STATEMENT_LISTS = {
    ast.ModelDecl: "models",
    ast.ParamDecl: "params",
    ast.StageDecl: "stages",
    ast.InputDecl: "inputs",
    ast.Flow: "flows",
    ast.ConstraintDecl: "constraints",
}
_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", '"': '"', "\\": "\\"}
_CONSTANTS = {"TRUE": True, "FALSE": False, "AUTO": ast.AUTO}


@v_args(meta=True)
class _AstBuilder(Transformer):
    """lark tree -> AST. Statement spans cover the statement's part on its first line."""

    def __init__(self, source: _Source, tokens: list[Token]):
        super().__init__(visit_tokens=False)
        self._src = source
        self._line_end = {token.line: token.end_column for token in tokens}

    def _statement_span(self, meta) -> Span:
        end = meta.end_column if meta.end_line == meta.line else self._line_end[meta.line]
        return self._src.span(meta.line, meta.column, end)

    def start(self, meta, children):
        return children[0]

    def pipeline(self, meta, children):
        name, *statements = children
        span = self._src.region(meta.line, meta.column, name.line, name.end_column)
        pipeline = ast.Pipeline(str(name), span)
        for statement in statements:
            for node in statement if isinstance(statement, tuple) else (statement,):
                getattr(pipeline, _STATEMENT_LISTS[type(node)]).append(node)
        return pipeline

    def model_decl(self, meta, children):
        return ast.ModelDecl(self._string(children[0]), self._statement_span(meta))

    def param_decl(self, meta, children):
        name, value = children
        return ast.ParamDecl(str(name), value.value, self._statement_span(meta))

    def stage_decl(self, meta, children):
        name, kind, args, device = children
        return ast.StageDecl(
            name=str(name),
            kind=str(kind),
            args=args,
            device=None if device is None else device.value,
            span=self._statement_span(meta),
            kind_span=self._src.token_span(kind),
            device_span=None if device is None else device.span,
        )

    def args(self, meta, children):
        return children

    def device(self, meta, children):
        name, index = children
        if index is None:
            return _Value(str(name), self._src.token_span(name))
        if not index.isdigit():
            raise ParseError(
                f"a device index is a plain number, not '{index}'",
                self._src.token_span(index),
                hint="write the device as, e.g., 'cuda' or 'cuda:1'",
            )
        return _Value(f"{name}:{index}", self._src.meta_span(meta))

    def input_decl(self, meta, children):
        name, type_, optional, default, route = children
        span = self._statement_span(meta)
        decl = ast.InputDecl(
            name=str(name),
            type=str(type_),
            default=None if default is None else default.value,
            span=span,
            type_span=self._src.token_span(type_),
            optional=optional is not None,
        )
        if route is None:
            return (decl,)
        source = ast.PortRef(str(name), None, self._src.token_span(name))
        return decl, ast.Flow(source, route.target, route.maps, route.attrs, span)

    def flow(self, meta, children):
        source, route = children
        return ast.Flow(source, route.target, route.maps, route.attrs, self._statement_span(meta))

    def route(self, meta, children):
        *chains, target, attrs = children
        maps = [op for chain in chains for op in chain]
        return _Route(maps, target, attrs or [])

    def map_chain(self, meta, children):
        return children

    def map_op(self, meta, children):
        name, *args = children
        return ast.MapOp(str(name), [arg.value for arg in args], self._src.meta_span(meta))

    def port(self, meta, children):
        node, port = children
        return ast.PortRef(
            str(node), None if port is None else str(port), self._src.meta_span(meta)
        )

    def output(self, meta, children):
        return ast.OutputRef(str(children[0]), self._src.meta_span(meta))

    def constraint(self, meta, children):
        kind, *names = children
        stages = [(str(name), self._src.token_span(name)) for name in names]
        return ast.ConstraintDecl(str(kind), stages, self._statement_span(meta))

    def attrs(self, meta, children):
        return children

    def attr(self, meta, children):
        key, value = children
        if value is None:
            return ast.Attr(key, None, self._src.meta_span(meta))
        return ast.Attr(key, value.value, self._src.meta_span(meta), value.span)

    def key(self, meta, children):
        return str(children[0])

    def value(self, meta, children):
        (child,) = children
        if isinstance(child, _Value):
            return child
        return _Value(self._literal(child), self._src.token_span(child))

    def dotted_name(self, meta, children):
        span = self._src.meta_span(meta)
        return _Value(ast.Name(".".join(children), span), span)

    def list(self, meta, children):
        return _Value([child.value for child in children], self._src.meta_span(meta))

    def _literal(self, token: Token) -> ast.Value:
        if token.type == "STRING":
            return self._string(token)
        if token.type == "INT":
            return self._int(token)
        if token.type == "FLOAT":
            return self._float(token)
        if token.type == "PARAM_REF":
            return Param(token[1:], self._src.token_span(token))
        return _CONSTANTS[token.type]

    def _string(self, token: Token) -> str:
        def unescape(match: re.Match) -> str:
            if match[1] in _ESCAPES:
                return _ESCAPES[match[1]]
            col = token.column + 1 + match.start()
            raise ParseError(
                f"unknown escape '\\{match[1]}' in a string",
                self._src.span(token.line, col, col + 2),
                hint='the escapes are \\" \\\\ and \\n',
            )

        return _ESCAPE.sub(unescape, token[1:-1])

    def _int(self, token: Token) -> int:
        try:
            return int(token)
        except ValueError:  # Python refuses to convert more than a few thousand digits
            raise ParseError("integer literal too long", self._src.token_span(token)) from None

    def _float(self, token: Token) -> float:
        number = float(token)
        if math.isinf(number):
            raise ParseError("number out of range", self._src.token_span(token))
        return number


# --- syntax errors -------------------------------------------------------------------

_KEYWORD_TYPES = frozenset(word.upper() for word in KEYWORDS)
_LITERAL_TYPES = frozenset({"STRING", "INT", "FLOAT", "PARAM_REF", "TRUE", "FALSE", "AUTO"})
# Expected-token sets that read better as one word than as a list of terminals.
# Checked in order: the attribute-key set (a key may be a reserved word) contains the others.
_GROUPS = (
    ("a name", _KEYWORD_TYPES | {"NAME"}),
    (
        "a statement",
        frozenset({"NAME", "MODEL", "PARAM", "STAGE", "INPUT", "COLOCATE", "SEPARATE"}),
    ),
    ("a value", _LITERAL_TYPES | {"NAME", "LSQB"}),
)
_TERMINAL_WORDS = {
    "$END": "end of file",
    "NAME": "a name",
    "STRING": "a string",
    "INT": "an integer",
    "FLOAT": "a number",
    "PARAM_REF": "a parameter reference",
}
_OPENERS = {"LBRACE": "RBRACE", "LPAR": "RPAR", "LSQB": "RSQB"}
_STATEMENT_KEYWORDS = frozenset(
    {"PIPELINE", "MODEL", "PARAM", "STAGE", "INPUT", "COLOCATE", "SEPARATE"}
)
_MAX_LISTED = 4

_ONE_PIPELINE = "a .omni file holds one `pipeline name { ... }` block"
_ARROW = "an edge is written '->'"
_FORMS = {
    "MODEL": 'the default model is a string: `model "org/name"`',
    "PARAM": "a parameter is declared `param name = value`",
    "STAGE": "a stage is declared `stage name = kind(key=value, ...)`",
    "INPUT": "an input is declared `input name: type [= default] [-> target]`",
}
_CHARACTER_HINTS = {
    ">": _ARROW,
    "\u2192": _ARROW,  # → and its look-alikes, pasted from prose
    "\u21d2": _ARROW,
    "\u27f6": _ARROW,
    "\u2794": _ARROW,
    "'": 'strings are written in double quotes: "text"',
    "\u201c": 'use straight double quotes: "text"',
    "\u201d": 'use straight double quotes: "text"',
    ";": "statements need no ';' between them",
    "$": "a parameter reference is written `$name`",
}


def _syntax_error(error: LarkError, source: _Source, history: list[Token], accepts) -> ParseError:
    """Translate a lark exception; `history` holds the tokens the parser accepted."""
    if isinstance(error, UnexpectedCharacters):
        return _bad_character(error, source)
    if not isinstance(error, UnexpectedToken):  # LALR raises no other kind; keep the promise
        return ParseError(f"invalid syntax ({type(error).__name__})", _end_span(source, history))
    if error.token.type == "$END":
        return _unexpected_end(source, history, accepts())
    return _unexpected_token(error.token, source, history, accepts())


def _bad_character(error: UnexpectedCharacters, source: _Source) -> ParseError:
    pos, line, col = error.pos_in_stream, error.line, error.column
    char = source.text[pos]
    span = source.span(line, col, col + 1)
    if char == '"':
        return ParseError(
            "unterminated string",
            source.span(line, col),
            hint="close the string on the same line (write \\n for a line break)",
        )
    if char == ">" and source.text[pos - 1 : pos] == "=":
        return ParseError("unexpected '=>'", source.span(line, col - 1, col + 1), _ARROW)
    hint = _CHARACTER_HINTS.get(char)
    if char == "$":
        return ParseError("expected a parameter name after '$'", span, hint)
    if not char.isascii():
        hint = hint or "outside strings and comments only ASCII is allowed"
        return ParseError(f"illegal character {_char_name(char)}", span, hint)
    if not char.isprintable():
        return ParseError(f"illegal character {_char_name(char)}", span, hint)
    return ParseError(f"unexpected character '{char}'", span, hint)


def _char_name(char: str) -> str:
    code = f"U+{ord(char):04X}"
    return f"'{char}' ({code})" if char.isprintable() else code


def _unexpected_token(
    token: Token, source: _Source, history: list[Token], expected: set[str]
) -> ParseError:
    span = source.token_span(token)
    at_statement = "STAGE" in expected or expected == {"$END"}
    if token.type == "PIPELINE" and at_statement:
        return _second_pipeline(span, history, expected)
    if expected == {"$END"}:
        return ParseError(
            f"unexpected {_describe(token)} after the end of the pipeline",
            span,
            hint="statements go inside the pipeline's braces",
        )
    if expected == {"PIPELINE"}:
        return ParseError(f"expected 'pipeline', found {_describe(token)}", span, _ONE_PIPELINE)
    if token.type in _KEYWORD_TYPES and "NAME" in expected:
        return ParseError(
            f"'{token}' is a reserved word", span, hint=f"use another name, such as '{token}_'"
        )
    if token.type == "EQUAL" and source.text.startswith(">", token.end_pos):
        double = source.span(token.line, token.column, token.column + 2)
        return ParseError("unexpected '=>'", double, _ARROW)
    message = f"unexpected {_describe(token)}{_expected_clause(expected)}"
    return ParseError(message, span, _token_hint(token, source, history, expected))


def _second_pipeline(span: Span, history: list[Token], expected: set[str]) -> ParseError:
    first = history[1]  # the first pipeline's name: history starts `pipeline NAME {`
    if expected == {"$END"}:
        return ParseError(
            "a file holds only one pipeline",
            span,
            hint=f"pipeline '{first}' is already declared at line {first.line}; "
            "move this one to its own file",
        )
    return ParseError(
        f"unexpected 'pipeline' inside pipeline '{first}'",
        span,
        hint=f"close pipeline '{first}' with '}}' first; a file holds only one pipeline",
    )


def _token_hint(
    token: Token, source: _Source, history: list[Token], expected: set[str]
) -> str | None:
    """The most likely mistake behind an unexpected token, if it looks like a common one."""
    opener = _unclosed(history)
    if opener and _left_open(opener, token, source, expected):
        return _unclosed_hint(opener)
    tail = [recent.type for recent in history[-2:]]
    for keyword, form in _FORMS.items():
        if tail[-1:] == [keyword] or tail == [keyword, "NAME"]:  # `stage ^` or `stage x ^`
            return form
    if token.type == "EQUAL" and "ARROW" in expected:
        return f"{_FORMS['STAGE']}; {_ARROW}"
    named = opener is not None and opener.type in ("LPAR", "LSQB") and "EQUAL" not in expected
    if token.type in _LITERAL_TYPES and "NAME" in expected and named:
        return "stage arguments and edge attributes are named: write `key=value`"
    return None


def _left_open(opener: Token, token: Token, source: _Source, expected: set[str]) -> bool:
    """Whether `token` shows that `opener` was never closed: it closes another kind of
    bracket, or it begins the next statement where the closing bracket could come."""
    closer = _OPENERS[opener.type]
    if token.type in _OPENERS.values():
        return token.type != closer
    return closer in expected and _starts_statement(token, source)


def _starts_statement(token: Token, source: _Source) -> bool:
    """A keyword that begins a statement, or a name followed by '->' or '.' (a flow's
    source); never an argument or attribute key, which a missing ',' would explain."""
    if token.type in _STATEMENT_KEYWORDS:
        return True
    rest = source.text[token.end_pos :].lstrip()
    return token.type == "NAME" and rest.startswith(("->", "."))


def _unexpected_end(source: _Source, history: list[Token], expected: set[str]) -> ParseError:
    if not history:
        return ParseError("no pipeline found", source.span(1, 1, 2), _ONE_PIPELINE)
    opener = _unclosed(history)
    hint = None if opener is None else _unclosed_hint(opener)
    message = f"unexpected end of file{_expected_clause(expected)}"
    return ParseError(message, _end_span(source, history), hint)


def _end_span(source: _Source, history: list[Token]) -> Span:
    """Just after the last token: where the missing text would go."""
    if not history:
        return source.span(1, 1, 2)
    last = history[-1]
    return source.span(last.end_line, last.end_column, last.end_column + 1)


def _unclosed(history: list[Token]) -> Token | None:
    """The innermost bracket still open after `history` (which lark accepted, so it nests)."""
    open_brackets: list[Token] = []
    for token in history:
        if token.type in _OPENERS:
            open_brackets.append(token)
        elif token.type in _OPENERS.values() and open_brackets:
            open_brackets.pop()
    return open_brackets[-1] if open_brackets else None


def _unclosed_hint(opener: Token) -> str:
    return f"the '{opener}' opened at line {opener.line}, column {opener.column} is not closed"


def _expected_clause(expected: set[str]) -> str:
    remaining = set(expected)
    words = []
    for word, group in _GROUPS:
        if group <= remaining:
            words.append(word)
            remaining -= group
    words += sorted(_terminal_word(name) for name in remaining)
    if not words or len(words) > _MAX_LISTED:
        return ""
    listed = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
    return f", expected {listed}"


@functools.cache
def _terminal_word(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    pattern = _lark().get_terminal(name).pattern
    return f"'{pattern.value}'" if isinstance(pattern, PatternStr) else name.lower()


def _describe(token: Token) -> str:
    text = token if len(token) <= 30 else f"{token[:27]}..."
    return f"string {text}" if token.type == "STRING" else f"'{text}'"


def _not_utf8(data: bytes, error: UnicodeDecodeError, path: str) -> ParseError:
    line_start = data.rfind(b"\n", 0, error.start) + 1
    line_end = data.find(b"\n", error.start)
    line = data[line_start : None if line_end < 0 else line_end]
    col = len(data[line_start : error.start].decode("utf-8", "replace")) + 1
    text = line.decode("utf-8", "replace").removesuffix("\r")
    span = Span(path, data.count(b"\n", 0, error.start) + 1, col, col + 1, text)
    return ParseError("the file is not valid UTF-8", span, hint="save it as UTF-8")
