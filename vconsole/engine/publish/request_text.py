"""Request text for the ``sched`` topic (`vconsole.telemetry.request_text`): token ids in,
bounded strings out, on the publisher thread.

The busy loop never decodes, nor copies: with ``publish_request_text`` on it hands over, with
each snapshot, a `TokenLists` per row among the table's first `TEXT_ROWS` — the request's own
prompt and output token id lists (the core's ``token_lists``: a dict lookup a row). The engine
only appends to those lists, so the publisher thread reads a consistent slice of them (a list
slice is atomic under the GIL); that is the one exception to "what is handed over belongs to
the publisher". Here a row is decoded only when it is new or its output grew since the last
snapshot — the prompt's first `HEAD_TOKENS` ids once, the output's last `TAIL_TOKENS` ids per
growth — so the steady cost is one decode per running request per snapshot and nothing for a
waiting one.

Invariants: the map `TextBook.body` returns has an entry for every row given and no other;
each prompt head holds at most `PROMPT_HEAD_CHARS` characters and each output tail at most
`OUTPUT_TAIL_CHARS`, both encodable as UTF-8 (msgpack must pack them); a tokenizer that raises
costs that row's text only (empty strings, this snapshot: a failed side is not kept, so the
next snapshot decodes it again), never the snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from vconsole.telemetry.request_text import output_tail, prompt_head

log = logging.getLogger(__name__)

# Token ids decoded per side: one per character kept, since a token is at least a byte (the
# byte-level built-in models' tokens are one byte each; a BPE token of prose is 3-5 characters).
HEAD_TOKENS = 200
TAIL_TOKENS = 200

# (engine request id, its prompt token ids, its output token ids): the request's own lists
TokenLists = tuple[str, list[int], list[int]]


def _utf8(text: str) -> str:
    """``text`` with anything UTF-8 cannot carry (a lone surrogate) replaced."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


class TextBook:
    """The strings of the rows last given, keyed by request id: a row is decoded again only
    when its prompt list is another one (a reused id) or its output length changed — or when
    a side failed to decode last time (a side that failed is sent empty and never kept: the
    next snapshot tries it again)."""

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self._detokenize = detokenize
        # id -> (prompt list, output length decoded, prompt head, output tail); a head that
        # failed is None, a tail that failed has output length -1 (both decoded again)
        self._rows: dict[str, tuple[list[int], int, str | None, str]] = {}
        self.decodes = 0          # detokenize calls so far (tests, the bench)
        self._failed = False

    def _decode(self, ids: list[int]) -> str | None:
        """The text of ``ids``; None when the tokenizer raised."""
        if not ids:
            return ""
        self.decodes += 1
        try:
            return _utf8(self._detokenize(ids))
        except Exception:
            if not self._failed:    # once: a broken tokenizer would fail every row
                self._failed = True
                log.exception("could not detokenize a request's text for telemetry; its row "
                              "is sent without text (tried again on the next snapshot)")
            return None

    def body(self, rows: Sequence[TokenLists]) -> dict[str, list[str]]:
        """``request_text`` for these rows: id -> [prompt head, output tail]."""
        known_rows = self._rows
        book: dict[str, tuple[list[int], int, str | None, str]] = {}
        out: dict[str, list[str]] = {}
        for rid, prompt, output in rows:
            num_output = len(output)
            known = known_rows.get(rid)
            if known is not None and known[0] is not prompt:   # a reused id: decoded anew
                known = None
            head = known[2] if known is not None else None
            if head is None:                                   # new, or failed last time
                decoded = self._decode(prompt[:HEAD_TOKENS])
                head = None if decoded is None else prompt_head(decoded)
            if known is not None and known[1] == num_output:
                tail_len, tail = num_output, known[3]
            else:                                              # new, grew, or failed
                decoded = self._decode(output[-TAIL_TOKENS:])
                tail_len, tail = ((-1, "") if decoded is None
                                  else (num_output, output_tail(decoded)))
            book[rid] = (prompt, tail_len, head, tail)
            out[rid] = [head or "", tail]
        self._rows = book
        return out
