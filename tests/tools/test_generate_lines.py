"""`vconsole generate` line parsing that needs no model: what makes a line an error."""

from vconsole.tools.generate import parse_line


def test_an_inner_blank_line_keeps_its_index_and_is_an_error():
    out = parse_line(None, 3, "   ")  # type: ignore[arg-type]
    assert out.request_id == "3" and out.finish_reason == "error" and out.error == "empty line"


def test_non_object_and_unknown_fields_are_errors_with_reasons():
    assert "JSON object" in parse_line(None, 0, "[1, 2]").error  # type: ignore[arg-type]
    assert "temperature" in parse_line(None, 1, '{"prompt": "a", "temperature": "hot"}').error  # type: ignore[arg-type]
