"""Request text on the wire: the ``sched`` topic's optional ``request_text`` map.

Off by default (``publish_request_text``, as vLLM logs prompts only when asked). When the engine
publishes it, every ``sched`` message carries ``request_text``: request id -> ``[prompt_head,
output_tail]`` for the rows among the first `TEXT_ROWS` of that message's table (the running
requests come first, then the head of the waiting queue), so each message is whole in itself —
a late subscriber, a recording read from the middle and ``top --once`` need no earlier message
— and its cost is bounded whatever the table's size: at most `TEXT_ROWS` x (`PROMPT_HEAD_CHARS`
+ `OUTPUT_TAIL_CHARS`) characters (~100 KB) a message, at the snapshot rate, whether the table
holds 100 rows or 10,000. The field is absent when text is off, so its presence says "text is
published" (an empty map: no row has text yet).

The strings are the model's text as decoded, cut to size, not made safe: every reader that
prints them passes them through `vconsole.telemetry.printable.printable` (the random-weight
models emit ESC and NUL like any other token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vconsole.shared.config import coerce_value

FIELD = "request_text"
KEY = "publish_request_text"      # the config key that turns it on
TEXT_ROWS = 256            # rows of a sched message that carry text: the first ones
PROMPT_HEAD_CHARS = 200    # the prompt's first characters
OUTPUT_TAIL_CHARS = 200    # the output's last characters (updated as it grows)
HOW_TO_TURN_ON = "--set publish_request_text=true"


@dataclass(frozen=True, slots=True)
class RequestText:
    prompt_head: str
    output_tail: str


def prompt_head(text: str) -> str:
    return text[:PROMPT_HEAD_CHARS]


def output_tail(text: str) -> str:
    """The last `OUTPUT_TAIL_CHARS` of ``text``, without the replacement characters a cut
    through a multi-byte character leaves at its start."""
    return text[-OUTPUT_TAIL_CHARS:].lstrip("\ufffd")


def turns_on(values: dict[str, Any]) -> bool:
    """Whether a config change (raw values, as ``set_config`` takes them) turns request text
    on; a value the config table rejects is not (the table says why)."""
    if KEY not in values:
        return False
    try:
        return bool(coerce_value(KEY, values[KEY]))
    except ValueError:
        return False


def published(sched: dict[str, Any] | None) -> bool:
    """Whether this ``sched`` body carries request text (the engine publishes it)."""
    return isinstance(sched, dict) and isinstance(sched.get(FIELD), dict)


def text_of(sched: dict[str, Any] | None, request_id: str) -> RequestText | None:
    """The text of one row of ``sched`` (None: not published, or not for this row). A
    malformed entry (another publisher's) reads as None, never raises."""
    if not published(sched):
        return None
    assert sched is not None
    entry = sched[FIELD].get(request_id)
    if (not isinstance(entry, list | tuple) or len(entry) != 2
            or not all(isinstance(s, str) for s in entry)):
        return None
    return RequestText(entry[0][:PROMPT_HEAD_CHARS], entry[1][-OUTPUT_TAIL_CHARS:])
