"""TextStream: incremental detokenization and stop strings, with the built-in byte tokenizer
(every UTF-8 byte is one token, so a character can span tokens and a stop string always does)."""

from __future__ import annotations

import pytest

from vconsole.engine.worker.tiny_model import EOS_ID, build_byte_tokenizer
from vconsole.entrypoints.openai.text import TextStream

TOK = build_byte_tokenizer()


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False).input_ids)


def feed(stream: TextStream, text: str, per: int = 1) -> list[str]:
    """Feed ``text``'s tokens ``per`` at a time; the deltas handed out."""
    tokens = ids(text)
    return [stream.add(tokens[i:i + per]) for i in range(0, len(tokens), per)]


def test_without_stop_strings_the_text_comes_out_as_it_is_decoded() -> None:
    s = TextStream(TOK)
    assert "".join(feed(s, "hello world")) == "hello world"
    assert s.finish() == "" and s.stopped is None


def test_a_character_split_over_tokens_is_held_until_complete() -> None:
    s = TextStream(TOK)
    deltas = feed(s, "né€")              # é is 2 bytes, € is 3
    assert "\ufffd" not in "".join(deltas)
    assert deltas == ["n", "", "é", "", "", "€"]


def test_an_incomplete_character_at_the_end_is_released_as_u_fffd() -> None:
    s = TextStream(TOK)
    s.add(ids("a")), s.add(ids("€")[:2])
    assert s.finish() == "\ufffd"
    assert s.text == "a\ufffd"


def test_a_stop_string_spanning_tokens_is_never_sent_not_even_in_part() -> None:
    s = TextStream(TOK, ["STOP"])
    deltas = feed(s, "abcSTOPdef")
    assert "".join(deltas) == "abc"
    assert all("S" not in d for d in deltas)     # the partial match was held back
    assert s.stopped == "STOP" and s.text == "abc"
    assert s.add(ids("more")) == "" and s.finish() == ""


def test_a_partial_match_that_does_not_complete_is_released() -> None:
    s = TextStream(TOK, ["STOP"])
    out = feed(s, "xSTOx")
    assert "".join(out) == "xSTOx"
    assert out[1:4] == ["", "", ""]             # "S", "ST", "STO" held back
    s2 = TextStream(TOK, ["STOP"])
    assert "".join(feed(s2, "xST")) == "x"
    assert s2.finish() == "ST"                   # the engine ended it: nothing held any more


def test_the_earliest_of_several_stop_strings_wins_and_include_keeps_it() -> None:
    s = TextStream(TOK, ["cd", "bcd"], include_stop_str_in_output=True)
    assert "".join(feed(s, "abcdef", per=6)) == "abcd"
    assert s.stopped == "bcd"
    s = TextStream(TOK, ["\n"])
    assert "".join(feed(s, "line one\nline two", per=3)) == "line one"


@pytest.mark.parametrize("per", [1, 2, 5])
def test_special_tokens_are_skipped_or_kept(per: int) -> None:
    s = TextStream(TOK)
    assert "".join(s.add(ids("ab")[i:i + per]) for i in range(0, 2, per)) + s.add([EOS_ID]) \
        == "ab"
    kept = TextStream(TOK, skip_special_tokens=False)
    assert kept.add(ids("ab") + [EOS_ID]) == "ab</s>"
