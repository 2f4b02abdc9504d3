"""TextStream: a request's output token ids in, the text to send out, stop strings applied.

The engine streams token ids; clients want text, and ``stop`` strings are matched on that text
(a stop string can span tokens, and a token can hold a partial UTF-8 character). Per output:

- the text is the detokenized ids (special tokens skipped), decoded again as ids arrive; a
  trailing U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it;
- the first stop string found ends the output: the text stops right before it (or after it with
  ``include_stop_str_in_output``), and `stopped` names it so the caller aborts the request in the
  engine;
- text that could still become a stop string (a suffix of the text that is a prefix of one) is
  held back, so a client never sees a stop string or the start of one; `finish` releases it when
  the engine ends the output for another reason.

Pure: no I/O, no engine; the tokenizer is anything with ``decode(ids, skip_special_tokens=)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *,
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""                  # the output's text so far (final once stopped)
        self.sent = 0                   # characters of ``text`` handed out
        self.stopped: str | None = None  # the stop string that ended the output

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Take the engine's new tokens; the text that may be sent now ("" for none)."""
        if self.stopped is not None or not new_token_ids:
            return ""
        self.token_ids.extend(int(t) for t in new_token_ids)
        text = self.tokenizer.decode(self.token_ids,
                                     skip_special_tokens=self.skip_special_tokens)
        complete = text.rstrip(INCOMPLETE) if text.endswith(INCOMPLETE) else text
        if self.stop:
            # A stop string that ends in the new text started at most len(stop)-1 characters
            # before the text already sent.
            start = max(0, self.sent - max(len(s) for s in self.stop) + 1)
            hit = _first_stop(complete, self.stop, start)
            if hit is not None:
                pos, stop = hit
                self.stopped = stop
                self.text = complete[:pos + (len(stop) if self.include_stop else 0)]
                return self._release(len(self.text))
        self.text = complete
        return self._release(len(complete) - _held_back(complete, self.stop, self.sent))

    def finish(self) -> str:
        """The engine ended the output: whatever was held back (a partial stop-string match, or
        an incomplete character as U+FFFD)."""
        if self.stopped is None and self.token_ids:
            self.text = self.tokenizer.decode(self.token_ids,
                                              skip_special_tokens=self.skip_special_tokens)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta


def _first_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text[start:]`` (position, string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def _held_back(text: str, stops: Sequence[str], sent: int) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (never
    reaching back into what was sent)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text) - sent), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
