"""`vconsole generate`: offline batch inference from a JSONL file to a JSONL file."""

from __future__ import annotations

import argparse
import json
import sys

from vconsole.commands import fail
from vconsole.engine.config_source import config_from_args
from vconsole.engine.core import EngineCore
from vconsole.engine.offline import run_batch
from vconsole.shared.config import ConfigError
from vconsole.telemetry.printable import printable
from vconsole.tools.generate import parse_line, result_line

MAX_ERROR_LINES = 20    # bad lines named on stderr (all of them get an error line in OUTPUT)


class _Progress:
    """A one-line progress bar on a terminal (stderr); silent otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or done == self.last:
            return
        self.last = done
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        sys.stderr.flush()
        if done == total:
            sys.stderr.write("\n")


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as e:
        return fail("generate", f"bad config: {e}", 2)
    try:
        with open(args.input, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        while lines and not lines[-1].strip():
            lines.pop()  # trailing blank lines are not requests; inner ones keep their index
    except OSError as e:
        return fail("generate", f"cannot read {args.input}: {e.strerror}", 2)
    try:
        core = EngineCore(config)
    except (ValueError, OSError) as e:  # the model or the KV pool: the loader says why
        return fail("generate", f"cannot start: {e}")
    requests = [parse_line(core, i, ln) for i, ln in enumerate(lines)]
    result = run_batch(core, requests, on_progress=_Progress(not args.no_progress))
    with open(args.output, "w", encoding="utf-8") as fh:
        for i, (out, toks) in enumerate(zip(result.outputs, result.output_token_ids,
                                            strict=True)):
            # json.dumps's default ensure_ascii writes every control character the model made
            # (ESC, NUL, ...) as a \u escape: the file is safe to cat.
            fh.write(json.dumps(result_line(i, out, toks)) + "\n")
    errors = [(i, o) for i, o in enumerate(result.outputs) if o.finish_reason == "error"]
    for i, out in errors[:MAX_ERROR_LINES]:
        # The reason may quote the line (or text the model made): escaped for the terminal.
        print(printable(f"{args.input}:{i + 1}: {out.error}"), file=sys.stderr)
    if len(errors) > MAX_ERROR_LINES:
        print(f"... and {len(errors) - MAX_ERROR_LINES} more (each has an error line in "
              f"{args.output})", file=sys.stderr)
    print(f"requests={len(lines)} errors={len(errors)} tokens={result.num_output_tokens} "
          f"tok/s={result.tokens_per_s:.1f} elapsed={result.elapsed_s:.2f}s "
          f"preemptions={result.num_preemptions} prefix_hit_rate={result.prefix_hit_rate:.1%}",
          file=sys.stderr)
    return 1 if errors else 0
