"""Invalid programs: each raises a ParseError at the right place, with a useful message."""

import pytest

from omniflow import dsl
from omniflow.errors import ParseError


def body(*lines: str) -> str:
    """A pipeline whose statements start on line 2."""
    return "pipeline p {\n" + "\n".join(lines) + "\n}\n"


# (source, "line:col", message substring, hint substring or None)
CASES = [
    ("", "1:1", "no pipeline found", "pipeline name {"),
    ("# nothing but a comment\n", "1:1", "no pipeline found", "pipeline name {"),
    ("stage x = ar()", "1:1", "expected 'pipeline', found 'stage'", "pipeline name {"),
    ("pipeline p", "1:11", "unexpected end of file, expected '{'", None),
    (
        "pipeline p {\n  a -> b\n",
        "2:9",
        "unexpected end of file",
        "'{' opened at line 1, column 12",
    ),
    (body("a => b"), "2:3", "unexpected '=>'", "'->'"),
    (body("param x => 1"), "2:9", "unexpected '=>'", "'->'"),
    (body("a → b"), "2:3", "illegal character '→' (U+2192)", "'->'"),
    (body("a b"), "2:3", "unexpected 'b', expected '->'", None),
    (body("param x: 5"), "2:8", "unexpected ':', expected '='", "param name = value"),
    (body("input x = text"), "2:9", "unexpected '=', expected ':'", "input name: type"),
    (body("stage x ar(a=1)"), "2:9", "unexpected 'ar', expected '='", "stage name = kind("),
    (body("talker = ar()"), "2:8", "unexpected '=', expected '->' or '.'", "stage name = kind("),
    (body('model "Qwen/Qwen2.5'), "2:7", "unterminated string", "same line"),
    (body("model Qwen"), "2:7", "unexpected 'Qwen', expected a string", 'model "org/name"'),
    (body("stage input = ar()"), "2:7", "'input' is a reserved word", "'input_'"),
    (body("a.output -> b"), "2:3", "'output' is a reserved word", "another name"),
    (
        body("stage x = ar(a=1"),
        "3:1",
        "unexpected '}', expected ')' or ','",
        "'(' opened at line 2",
    ),
    (body("stage x = ar(a=1]"), "2:17", "unexpected ']'", "'(' opened at line 2, column 13"),
    # A bracket left open shows where the next statement begins.
    (
        body('stage a = ar(component="thinker"', "stage b = ar()"),
        "3:1",
        "unexpected 'stage', expected ')' or ','",
        "the '(' opened at line 2, column 13 is not closed",
    ),
    (
        body('stage a = ar(component="thinker"', "a.text -> output t"),
        "3:1",
        "unexpected 'a', expected ')' or ','",
        "'(' opened at line 2, column 13",
    ),
    (
        body("a -> map(gain(0.9)", "b -> c"),
        "3:1",
        "unexpected 'b'",
        "'(' opened at line 2, column 9",
    ),
    (body("a -> b [stream", "b -> c"), "3:1", "unexpected 'b'", "'[' opened at line 2, column 8"),
    (body("param x = [1, 2", "param y = 3"), "3:1", "'param'", "'[' opened at line 2, column 11"),
    # ...but a key on the next line says a ',' is missing, not a bracket.
    (body("stage x = ar(a=1", "b=2)"), "3:1", "unexpected 'b', expected ')' or ','", None),
    (body('stage x = ar("thinker")'), "2:14", 'string "thinker", expected a name or', "key=value"),
    (body("a -> b [5]"), "2:9", "unexpected '5', expected a name", "key=value"),
    (body("a -> b [stream"), "3:1", "expected ',', '=' or ']'", "'[' opened at line 2, column 8"),
    (body("param x ="), "3:1", "unexpected '}', expected a value", None),
    (body("param x = [1 2]"), "2:14", "unexpected '2', expected ',' or ']'", None),
    (body("a -> map() -> b"), "2:10", "unexpected ')', expected a name", None),
    (body("a -> output"), "3:1", "unexpected '}', expected a name", None),
    (body("colocate a"), "3:1", "unexpected '}', expected ','", None),
    (body("stage x = ar() @ cuda:-1"), "2:23", "device index is a plain number", "'cuda:1'"),
    (body('param x = "a\\tb"'), "2:13", "unknown escape '\\t'", '\\"'),
    (body("param x = 'a'"), "2:11", "unexpected character '''", "double quotes"),
    (body("param x = “a”"), "2:11", "illegal character '“'", "straight double quotes"),
    (body("stage é = ar()"), "2:7", "illegal character 'é' (U+00E9)", "only ASCII"),
    (body("param x = 1\x00"), "2:12", "illegal character U+0000", None),
    (body("a -> b;"), "2:7", "unexpected character ';'", "no ';'"),
    (body("param x = $"), "2:11", "expected a parameter name after '$'", "$name"),
    (body("param x = 1e999"), "2:11", "number out of range", None),
    (body("param x = 1" + "0" * 5000), "2:11", "integer literal too long", None),
    (body("param x = " + "[" * 40 + "]" * 40), "2:43", "nested more than 32 deep", "flatten"),
    (body("pipeline q {}"), "2:1", "unexpected 'pipeline' inside pipeline 'p'", "close pipeline"),
    ("pipeline a {}\npipeline b {}\n", "2:1", "only one pipeline", "'a' is already declared"),
    ("pipeline a {}\nstage x = y()\n", "2:1", "after the end of the pipeline", "inside"),
    ("pipelinex a {}", "1:1", "expected 'pipeline', found 'pipelinex'", "pipeline name {"),
]


@pytest.mark.parametrize(("source", "where", "message", "hint"), CASES, ids=[c[2] for c in CASES])
def test_syntax_error(source, where, message, hint):
    with pytest.raises(ParseError) as caught:
        dsl.parse(source, "bad.omni")
    error = caught.value
    assert str(error.span) == f"bad.omni:{where}", error.render()
    assert message in error.message, error.render()
    if hint is None:
        assert error.hint is None, error.render()
    else:
        assert error.hint is not None and hint in error.hint, error.render()
    line = error.span.line
    assert error.span.line_text == (source.split("\n")[line - 1] if source else "")


def test_expected_tokens_are_readable_words():
    with pytest.raises(ParseError) as caught:
        dsl.parse(body("a.b -> c d"))
    message = caught.value.message
    assert "NAME" not in message and "LSQB" not in message and "__" not in message


def test_expected_tokens_are_listed_only_when_few():
    # Grouping keeps real lists short, so the cut-off is checked on the helper itself.
    assert dsl.parser._expected_clause({"COMMA", "RPAR"}) == ", expected ')' or ','"
    assert dsl.parser._expected_clause({"STRING", "INT", "FLOAT", "TRUE", "FALSE", "AUTO"}) == ""


def test_rendered_error():
    source = body('stage talker = ar(component="talker")', "thinker.hidden =>  talker")
    with pytest.raises(ParseError) as caught:
        dsl.parse(source, "graphs/chat.omni")
    assert caught.value.render() == (
        "graphs/chat.omni:3:16: error: unexpected '=>'\n"
        "  thinker.hidden =>  talker\n"
        "                 ^^\n"
        "hint: an edge is written '->'"
    )
    assert str(caught.value) == caught.value.render()


def test_parse_file_rejects_invalid_utf8(tmp_path):
    path = tmp_path / "latin1.omni"
    path.write_bytes(b'pipeline p {\n  model "caf\xe9"\n}\n')
    with pytest.raises(ParseError) as caught:
        dsl.parse_file(path)
    assert str(caught.value.span) == f"{path}:2:13"
    assert "not valid UTF-8" in caught.value.message


def test_parse_file_reports_missing_file(tmp_path):
    with pytest.raises(ParseError, match="cannot read"):
        dsl.parse_file(tmp_path / "missing.omni")


def test_deep_nesting_is_rejected_without_recursion():
    with pytest.raises(ParseError, match="nested more than 32 deep"):
        dsl.parse(body("param x = " + "[" * 100_000))


@pytest.mark.parametrize("word", sorted(dsl.parser.KEYWORDS))
def test_every_reserved_word_is_refused_as_a_name(word):
    with pytest.raises(ParseError, match=f"'{word}' is a reserved word"):
        dsl.parse(body(f"stage s = ar() @ {word}"))


def test_unterminated_string_carets_the_rest_of_the_line():
    with pytest.raises(ParseError) as caught:
        dsl.parse(body('  model "Qwen/Qwen2.5   # forgot the quote'))
    span = caught.value.span
    assert (span.col, span.end_col) == (9, len(span.line_text) + 1)
