"""Tool calls out of a choice's text, as it streams: content and OpenAI's ``tool_calls`` deltas.

One `ToolCallStream` per choice takes the text as the server detokenizes it (`feed`, then
`finish` when the engine ended the output) and returns events, in order: ``("content",
text)`` and ``("tool_calls", [delta])``. A call's first delta is its head, ``{"index", "id",
"type": "function", "function": {"name", "arguments": ""}}``, sent once its name is known;
then ``{"index", "function": {"arguments": fragment}}`` as the arguments' text arrives, so the
fragments joined are the arguments' JSON text, as OpenAI streams them. A whole response is the
same events joined (`result`): the non-streamed and the streamed answers are the same calls.

Three kinds, by ``tool_choice``:

- `NamedCall` (a named function): the whole text is the arguments of that one call;
- `RequiredCalls` (``"required"``): the text is a JSON array of ``{"name", "parameters"}``;
- `HermesCalls` (``"auto"`` with ``--tool-call-parser hermes``): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks anywhere in the text; the text outside them is the
  content. Text that could be the start of a tag is held back until it is known not to be
  (as a stop string is); whitespace around the call blocks is not content. A block is a call
  once its object's name is read (its head is then streamed: a stream cannot take it back),
  whatever follows in the block; a block that ends (or the output ends) with no name read
  (not JSON, not an object, a name that is not a string) is content, tags and all, with the
  whitespace around it, as it was written. With ``parallel_tool_calls: false`` blocks after
  the first call are dropped.

The JSON is read by `_CallScanner`, a character state machine resumed on each piece: O(new
text) per step, never a reparse of the whole text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

Event = tuple[str, Any]      # ("content", str) or ("tool_calls", list of deltas)
TOOL_CALL_PARSERS = ("hermes",)
WHITESPACE = " \t\r\n"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One call as it is read: its name once known, its arguments' text so far."""

    id: str
    name: str | None = None
    arguments: str = ""
    done: bool = False              # its JSON object closed
    head_sent: bool = False
    sent: int = 0                   # characters of ``arguments`` sent

    def body(self) -> dict[str, Any]:
        """As ``message.tool_calls`` carries it."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class _CallScanner:
    """Reads call objects ``{"name": "...", <args_key>: <value>}`` out of JSON text fed in
    pieces. ``depth`` 1: the text is one such object; 2: an array of them. The arguments are
    the value's own text (whitespace and all); the name is the decoded string."""

    def __init__(self, args_key: str, depth: int) -> None:
        self.args_key = args_key
        self.depth = depth
        self.calls: list[ToolCall] = []
        self.stack: list[str] = []
        self.in_string = False
        self.escape = False
        self.phase = ""             # in a call object: key, colon, value, in_value, after
        self.key: list[str] | None = None     # a key being read (raw)
        self.current_key = ""
        self.capture = ""           # "name" or "args": the value being read
        self.capture_kind = ""      # container, string or scalar
        self.raw_name: list[str] = []

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _char(self, ch: str) -> None:
        call = self.calls[-1] if self.calls and not self.calls[-1].done else None
        at_call = call is not None and len(self.stack) == self.depth
        if self.in_string:
            closing = False
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string, closing = False, True
            if self.capture == "args" and call is not None:
                call.arguments += ch
            elif closing:
                pass
            elif self.key is not None:
                self.key.append(ch)
            elif self.capture == "name":
                self.raw_name.append(ch)
            if closing and at_call and call is not None:
                self._string_closed(call)
            return
        if at_call and self.phase == "value" and ch not in WHITESPACE:
            self._value_starts(ch)
        if at_call and self.capture == "args" and self.capture_kind == "scalar" \
                and ch in ",}" + WHITESPACE:
            self._end_capture()              # a bare value ends before this character
        if self.capture == "args" and call is not None:
            call.arguments += ch
        if ch == '"':
            self.in_string = True
            if at_call and self.phase == "key":
                self.key = []
        elif ch in "{[":
            opens_call = ch == "{" and len(self.stack) == self.depth - 1 and (
                self.depth == 1 or self.stack == ["["])
            self.stack.append(ch)
            if opens_call:
                self.calls.append(ToolCall(call_id()))
                self.phase, self.current_key = "key", ""
        elif ch in "}]":
            if self.stack:
                self.stack.pop()
            if at_call and ch == "}":        # the call object itself closed
                assert call is not None
                call.done = True
                self.phase = ""
            elif self.capture == "args" and len(self.stack) == self.depth:
                self._end_capture()          # the arguments' object (or array) closed
        elif at_call and ch == ":" and self.phase == "colon":
            self.phase = "value"
        elif at_call and ch == ",":
            self.phase = "key"

    def _value_starts(self, ch: str) -> None:
        self.phase = "in_value"
        if self.current_key == self.args_key:
            self.capture = "args"
        elif self.current_key == "name" and ch == '"':
            self.capture, self.raw_name = "name", []
        self.capture_kind = ("container" if ch in "{[" else "string" if ch == '"'
                             else "scalar")

    def _string_closed(self, call: ToolCall) -> None:
        if self.key is not None:
            self.current_key = _decode("".join(self.key)) or ""
            self.key = None
            self.phase = "colon"
        elif self.capture == "name":
            call.name = _decode("".join(self.raw_name))
            self._end_capture()
        elif self.capture == "args" and self.capture_kind == "string":
            self._end_capture()

    def _end_capture(self) -> None:
        self.capture = ""
        self.capture_kind = ""
        self.phase = "after"


def _decode(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolCallStream:
    """The calls of one choice; subclasses read them out of the text."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content: list[str] = []

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def result(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's ``content`` (None when empty) and ``tool_calls``: the calls whose name
        is known, after `finish`."""
        calls = [c.body() for c in self.calls if c.name is not None]
        return "".join(self.content) or None, calls

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        self.content.append(text)
        return [("content", text)]

    def _deltas(self, calls: list[ToolCall], final: bool = False) -> list[Event]:
        """The heads and argument fragments not sent yet (``final``: a call's arguments
        that never came are ``{}``)."""
        events: list[Event] = []
        for call in calls:
            if call.name is None:
                continue
            if call not in self.calls:
                self.calls.append(call)
            index = self.calls.index(call)
            if final and not call.arguments.strip():
                call.arguments = "{}"
            if not call.head_sent:
                call.head_sent = True
                events.append(("tool_calls", [{"index": index, "id": call.id,
                                               "type": "function", "function": {
                                                   "name": call.name, "arguments": ""}}]))
            if len(call.arguments) > call.sent:
                events.append(("tool_calls", [{"index": index, "function": {
                    "arguments": call.arguments[call.sent:]}}]))
                call.sent = len(call.arguments)
        return events


class NamedCall(ToolCallStream):
    """The whole text is the arguments of the one call ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.call = ToolCall(call_id(), name)

    def feed(self, text: str) -> list[Event]:
        self.call.arguments += text
        return self._deltas([self.call])

    def finish(self) -> list[Event]:
        self.call.done = True
        return self._deltas([self.call], final=True)


class RequiredCalls(ToolCallStream):
    """The text is a JSON array of ``{"name", "parameters"}`` (``tool_choice: "required"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scanner = _CallScanner("parameters", depth=2)
        self.text: list[str] = []

    def feed(self, text: str) -> list[Event]:
        self.text.append(text)
        self.scanner.feed(text)
        return self._deltas(self.scanner.calls)

    def finish(self) -> list[Event]:
        """No call in the text (an output cut before its first name): the text, as content."""
        events = self._deltas(self.scanner.calls, final=True)
        return events if self.calls else self._content("".join(self.text))


class HermesCalls(ToolCallStream):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks in free text."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.parallel = parallel
        self.buf = ""                  # not yet read: a tag may start here
        self.block: _CallScanner | None = None   # inside a block: its reader
        self.raw: list[str] = []       # the block's text so far, its start tag and all
        self.ws_before = ""            # the whitespace held before the block
        self.pending_ws = ""           # whitespace held: content only if more content follows
        self.after_block = False       # whitespace right after a call block is not content
        self.skipping = False          # a block after the first call with parallel false

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._read(final=False)

    def finish(self) -> list[Event]:
        events = self._read(final=True)
        if self.block is not None or self.skipping:   # a block the output never closed
            events += self._close_block(end="")
        if not self.calls and self.pending_ws:     # no call: the text is all content
            events += self._content(self.pending_ws)
        self.pending_ws = ""
        return events

    def _read(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            tag = self.END if self.block is not None or self.skipping else self.START
            at = self.buf.find(tag)
            if at < 0:
                keep = 0 if final else _partial(self.buf, tag)
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                events += self._piece(piece)
                return events
            piece, self.buf = self.buf[:at], self.buf[at + len(tag):]
            events += self._piece(piece)
            if tag == self.START:
                self.ws_before, self.pending_ws = self.pending_ws, ""
                if self.parallel or not self.calls:
                    self.block, self.raw = _CallScanner("arguments", depth=1), [tag]
                else:
                    self.skipping = True
            else:
                events += self._close_block(end=tag)

    def _piece(self, piece: str) -> list[Event]:
        if not piece:
            return []
        if self.skipping:
            return []
        if self.block is not None:
            self.raw.append(piece)
            self.block.feed(piece)
            return self._deltas(self.block.calls[:1])
        if self.after_block:
            piece = piece.lstrip(WHITESPACE)
            if not piece:
                return []
            self.after_block = False
        piece = self.pending_ws + piece
        body = piece.rstrip(WHITESPACE)
        self.pending_ws = piece[len(body):]
        return self._content(body)

    def _close_block(self, end: str) -> list[Event]:
        """The block ended (at ``end``, its end tag, or with the output): its call's last
        deltas, or, when it named none, its text as content."""
        events: list[Event] = []
        block, self.block, self.skipping = self.block, None, False
        if block is None:                       # a block dropped (parallel false)
            self.after_block = True
        elif block.calls and block.calls[0].name is not None:
            events = self._deltas(block.calls[:1], final=True)
            self.after_block = True
        else:                                   # not a call: the text as it was written
            events = self._content(self.ws_before + "".join(self.raw) + end)
            self.after_block = False
        self.raw, self.ws_before = [], ""
        return events


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
