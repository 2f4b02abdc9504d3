"""Text from elsewhere made safe to print on a terminal: control characters as visible escapes.

What the engine's clients and models produce reaches screens and printers unchanged: generated
text (the built-in random-weight models emit ESC, NUL, form feeds, any token at all), request
ids a client chose, engine names, error messages that quote them. Printed raw, an ESC starts a
terminal escape sequence (cursor moves, colours, a cleared screen, a changed window title) and
bidirectional overrides reorder what follows. `printable` writes each such character as the
escape Python would (``\\x1b``, ``\\x00``, ``\\u202e``), so the text stays readable and the
terminal stays intact. The console (`vconsole.console`) and every CLI printer use this one
function; it is here, in ``telemetry``, because both may import it (the import contracts).
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls (U+0080-U+009F: 8-bit CSI and friends), the line and paragraph
# separators, and the bidirectional embeddings / overrides / isolates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
_KEPT_IN_LINES = frozenset("\n\t")


def _escaped(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}")


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control character written as a visible escape. ``keep_newlines``:
    leave ``\\n`` and ``\\t`` as they are (multi-line text, such as a completion printed whole);
    a single-line field (an id, a table cell) escapes them too."""
    if not _UNSAFE.search(text):
        return text

    def sub(m: re.Match[str]) -> str:
        ch = m.group()
        return ch if keep_newlines and ch in _KEPT_IN_LINES else _escaped(ch)
    return _UNSAFE.sub(sub, text)
