"""`vconsole record FILE`: save the telemetry stream to a file.

When the recording of a vconsole engine ends, the engine's request trace of the same time
(`get_trace` over its control socket, ``--control``) is written beside it as
``FILE.trace.jsonl``; an engine that does not answer gets a one-line note and the recording
stands on its own.
"""

from __future__ import annotations

import argparse
import sys
import time

from vconsole.commands import fail
from vconsole.commands.attach_targets import has_targets, targets_from
from vconsole.commands.curve_args import client_curve
from vconsole.security.curve import ClientCurve, CurveKeyError
from vconsole.security.endpoints import DEFAULT_CONTROL, DEFAULT_TELEMETRY
from vconsole.telemetry.record import fetch_trace, record_stream, save_trace, trace_path
from vconsole.wire.control import ControlError


def main(args: argparse.Namespace) -> int:
    """`vconsole record FILE [--telemetry EP | --vllm URL | fleet flags] [--duration S]`."""
    if has_targets(args):
        return _record_fleet(args)
    if getattr(args, "vllm", None):
        return _record_vllm(args)
    endpoint = getattr(args, "telemetry", None) or DEFAULT_TELEMETRY
    duration = getattr(args, "duration", None)
    try:
        curve = client_curve(args)
    except CurveKeyError as e:
        return fail("record", e, 2)
    print(f"recording {endpoint} to {args.file}"
          + (f" for {duration:g} s" if duration else " until Ctrl-C"), file=sys.stderr)
    started = time.monotonic()
    counts = record_stream(endpoint, args.file, duration, curve=curve)
    total = sum(counts.values())
    detail = ", ".join(f"{t} {n}" for t, n in counts.items() if n)
    print(f"recorded {total} messages to {args.file}" + (f" ({detail})" if detail else ""))
    if not total:
        print(f"note: nothing arrived from {endpoint}; is the engine running?", file=sys.stderr)
    else:
        _save_trace(args, time.monotonic() - started, curve)
    return 0


def _save_trace(args: argparse.Namespace, elapsed_s: float, curve: ClientCurve | None) -> None:
    """The engine's request trace of the recording's time (at most the engine's last five
    minutes), beside the recording."""
    control = getattr(args, "control", None) or DEFAULT_CONTROL
    telemetry = getattr(args, "telemetry", None) or DEFAULT_TELEMETRY
    if control == DEFAULT_CONTROL and telemetry != DEFAULT_TELEMETRY:
        # Another engine's telemetry: the default control endpoint may be a different engine.
        print("note: no request trace beside the recording: give --control of the engine "
              "recorded (its telemetry is not the default endpoint)", file=sys.stderr)
        return
    path = trace_path(args.file)
    try:
        text = fetch_trace(control, elapsed_s + 1.0, curve=curve)
    except (TimeoutError, ControlError) as e:
        print(f"note: no request trace beside the recording (control {control}: {e})",
              file=sys.stderr)
        return
    try:
        counts = save_trace(path, text)
    except OSError as e:
        print(f"note: no request trace beside the recording: cannot write {path}: "
              f"{e.strerror or e}", file=sys.stderr)
        return
    print(f"request trace: {counts['request']} requests and {counts['step']} steps to {path}")


def _record_vllm(args: argparse.Namespace) -> int:
    from vconsole.console.sources.vllm import ScrapeError, VllmScraper
    from vconsole.telemetry.record import Recorder

    try:
        scraper = VllmScraper(args.vllm)
    except ValueError as e:
        return fail("record", f"--vllm: {e}", 2)
    duration = getattr(args, "duration", None)
    print(f"recording {scraper.url} to {args.file}"
          + (f" for {duration:g} s" if duration else " until Ctrl-C"), file=sys.stderr)
    deadline = None if duration is None else time.monotonic() + duration
    total = 0
    try:
        with Recorder(args.file) as rec:
            while deadline is None or time.monotonic() < deadline:
                try:
                    for frames in scraper.scrape():
                        rec.write(frames)
                        total += 1
                    rec.flush()
                except ScrapeError as e:
                    print(f"vconsole record: {e}", file=sys.stderr)
                left = scraper.translator.interval_s if deadline is None else \
                    min(scraper.translator.interval_s, deadline - time.monotonic())
                time.sleep(max(0.0, left))
    except KeyboardInterrupt:
        pass
    print(f"recorded {total} messages from {scraper.scrapes} scrapes to {args.file}")
    return 0 if total else 1


def _record_fleet(args: argparse.Namespace) -> int:
    """Every target of the fleet flags into one recording, each under its target's name
    (`vconsole.console.sources.fleet.recording`); `vconsole replay` plays it as a fleet."""
    from vconsole.console.sources.fleet.recording import record_fleet
    from vconsole.console.sources.fleet.targets import TargetError

    try:
        targets = targets_from(args)
    except TargetError as e:
        return fail("record", e, 2)
    total, problems = record_fleet(targets, args.file, getattr(args, "duration", None),
                                   log=lambda m: print(m, file=sys.stderr))
    for line in problems:
        print(f"vconsole record: {line}", file=sys.stderr)
    print(f"recorded {total} messages from {len(targets)} target(s) to {args.file}")
    return 0 if total else 1
