"""The Requests screen's detail pane: one request's figures, its prompt head and output tail.

`RequestDetail.show` takes the row (a map of the ``sched`` topic's request columns) and what
the engine published of its text (`vconsole.telemetry.request_text`), and says plainly why
there is no text when there is none: not published (and how to turn it on), not sent for this
row (only the table's first rows carry text), or the request has left the table. Every string
from the wire is made terminal-safe (`vconsole.console.format.escape`): the random-weight
models emit ESC, NUL and any byte at all.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console.requests_view import grammar_label
from vconsole.telemetry.request_text import (
    HOW_TO_TURN_ON,
    OUTPUT_TAIL_CHARS,
    PROMPT_HEAD_CHARS,
    TEXT_ROWS,
    RequestText,
)

_STATE_STYLE = {"running": "$success", "waiting": "$warning", "preempted": "$error",
                "compiling": "$accent"}


def _one_line(text: str) -> str:
    """Wire text as markup on flowing lines: line breaks shown as ↵, controls escaped."""
    return fmt.escape(text.replace("\r\n", "\n").replace("\n", "↵ "))


def figures(row: dict[str, Any], gone: bool) -> str:
    """The row's figures as two lines of markup."""
    state = str(row.get("state", "?"))
    style = _STATE_STYLE.get(state, "$text-muted")
    state_text = f"[{style}]{fmt.escape(state)}[/]" if not gone else \
        f"[$text-muted]{fmt.escape(state)} → gone (finished or aborted)[/]"
    first = " · ".join([f"[b]{fmt.escape(str(row.get('id', '?')))}[/]", state_text,
                        f"prio {fmt.count(row.get('priority'))}",
                        f"age {fmt.duration(row.get('age_s'))}"])
    grammar = grammar_label(row)
    second = " · ".join([f"prompt {fmt.count(row.get('num_prompt_tokens'))} tok",
                         f"output {fmt.count(row.get('num_output_tokens'))} tok",
                         f"{fmt.count(row.get('num_blocks'))} KV blocks",
                         *([f"grammar {fmt.escape(grammar)}"] if grammar else []),
                         *([fmt.escape(str(row["spec"]))] if row.get("spec") else [])])
    return f"{first}\n[$text-muted]{second}[/]"


class RequestDetail(Vertical):
    """Hidden until the screen adds the ``-open`` class."""

    def compose(self) -> ComposeResult:
        yield Static(id="detail-figures")
        yield Static(id="detail-prompt")
        yield Static(id="detail-output")

    def show(self, row: dict[str, Any] | None, text: RequestText | None, *, published: bool,
             gone: bool = False) -> None:
        """``row`` None: no request selected. ``published``: the engine sends request text."""
        self.border_title = "request · esc closes"
        fig, prompt, output = (self.query_one(f"#detail-{n}", Static)
                               for n in ("figures", "prompt", "output"))
        if row is None:
            fig.update(Content.from_markup("[$text-muted]no request selected[/]"))
            prompt.update("")
            output.update("")
            return
        fig.update(Content.from_markup(figures(row, gone)))
        if text is not None:
            prompt.update(Content.from_markup(
                f"[b $accent]prompt[/] [$text-muted](first {PROMPT_HEAD_CHARS} characters)"
                f"[/]\n{_one_line(text.prompt_head) or '[$text-muted](empty)[/]'}"))
            output.update(Content.from_markup(
                f"[b $accent]output[/] [$text-muted](last {OUTPUT_TAIL_CHARS} characters)[/]"
                f"\n{_one_line(text.output_tail) or '[$text-muted](no output yet)[/]'}"))
            return
        if not published:
            why = ("[b]Request text is not published[/] (off by default). Start the engine "
                   f"with [b]{HOW_TO_TURN_ON}[/] or run [b]vconsole set "
                   "publish_request_text=true[/] (loopback or CURVE telemetry only).")
        elif gone:
            why = "[$text-muted]This request has left the table; its text was not seen.[/]"
        else:
            why = (f"[$text-muted]Text is sent for the table's first {TEXT_ROWS} rows only "
                   "(running requests, then the head of the queue); this row is further "
                   "back.[/]")
        prompt.update(Content.from_markup(why))
        output.update("")
