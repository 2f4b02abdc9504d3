"""`vconsole top` with targets (``--target``, ``--fleet``, ``--discover``): the fleet's rows as
JSON (``--once --json``: `vconsole.console.sources.fleet.snapshot.document`) or a table."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from vconsole.commands import fail
from vconsole.commands.attach_targets import targets_from
from vconsole.telemetry.printable import printable


def main_fleet(args: argparse.Namespace) -> int:
    from vconsole.console.sources.fleet.snapshot import (
        FleetWatch,
        build_sources,
        document,
        snapshot,
    )
    from vconsole.console.sources.fleet.targets import TargetError

    as_json = bool(getattr(args, "json", False))
    timeout = float(getattr(args, "timeout", 10.0) or 10.0)
    if getattr(args, "prometheus", None) or getattr(args, "selector", None):
        return _main_prometheus(args, as_json)
    try:
        targets = targets_from(args)
    except TargetError as e:
        return fail("top", e, 2)
    if getattr(args, "once", False):
        doc, problems = snapshot(targets, timeout)
        for line in problems:
            print(printable(f"vconsole top: {line}"), file=sys.stderr)
        _print(doc, as_json)
        return 0 if doc["aggregate"]["engines_up"] else 1
    sources, problems = build_sources(targets)
    for line in problems:
        print(printable(f"vconsole top: {line}"), file=sys.stderr)
    watch = FleetWatch(sources).start()
    try:
        while True:
            time.sleep(1.0)
            _print(document(watch.rows(), time.time()), as_json, flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        watch.stop()


def _main_prometheus(args: argparse.Namespace, as_json: bool) -> int:
    """The fleet from Prometheus: one read (``--once``) or one every 2 s; a read that fails is
    one line on stderr (``--once``: exit 1), and the next read tries again."""
    from vconsole.commands.attach_targets import prometheus_source
    from vconsole.console.sources.fleet.prometheus_rows import PrometheusFleet
    from vconsole.console.sources.fleet.targets import TargetError

    try:
        source = prometheus_source(args)
    except TargetError as e:
        return fail("top", e, 2)
    fleet = PrometheusFleet(source, started=time.time())
    while True:
        if not source.read_once():
            print(printable(f"vconsole top: {source.problem}"), file=sys.stderr, flush=True)
            if getattr(args, "once", False):
                return 1
        else:
            doc = fleet.document(time.time())
            _print(doc, as_json, flush=True)
            if getattr(args, "once", False):
                return 0 if doc["aggregate"]["engines_up"] else 1
        try:
            time.sleep(source.backoff_s())
        except KeyboardInterrupt:
            return 0


def _print(doc: dict[str, Any], as_json: bool, flush: bool = False) -> None:
    from vconsole.commands.top import strict_json

    if as_json:
        print(strict_json(doc), flush=flush)
        return
    for line in table(doc):
        print(printable(line), flush=flush)


def _f(v: Any, spec: str, scale: float = 1.0) -> str:
    return format(v * scale, spec) if isinstance(v, int | float) else "-"


def _ms(v: Any) -> str:
    return _f(v, ".0f", 1000) + "ms" if isinstance(v, int | float) else "-"


def table(doc: dict[str, Any]) -> list[str]:
    """One line per engine, then the fleet's."""
    head = f"{'NAME':<18} {'KIND':<9} {'STATE':<8} {'RUN':>4} {'WAIT':>4} {'KV':>5} " \
           f"{'TOK/S':>7} {'TTFT99':>7} {'ITL99':>7}"
    lines = [time.strftime("%H:%M:%S"), head]
    for e in doc["engines"]:
        kv = _f(e["kv_usage"], ".0%") + ("~" if e["kv_usage_estimated"] else "")
        lines.append(f"{e['name'][:18]:<18} {e['kind']:<9} {e['state']:<8} "
                     f"{_f(e['running'], '.0f'):>4} {_f(e['waiting'], '.0f'):>4} {kv:>5} "
                     f"{_f(e['gen_tok_s'], '.0f'):>7} {_ms(e['ttft_p99_s']):>7} {_ms(e['itl_p99_s']):>7}")
    a = doc["aggregate"]
    lines.append(f"{'fleet':<18} {'':<9} {str(a['engines_up']) + ' up':<8} "
                 f"{_f(a['running'], '.0f'):>4} {_f(a['waiting'], '.0f'):>4} {'':>5} "
                 f"{_f(a['gen_tok_s'], '.0f'):>7} {_ms(a['ttft_p99_s']):>7} {_ms(a['itl_p99_s']):>7}")
    lines += [f"! {f['message']}" for f in doc["imbalance"]]
    return lines
