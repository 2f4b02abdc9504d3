"""`vconsole set KEY=VALUE ...` and `vconsole get [KEY ...]`: the control channel for scripts.

Exit codes say what happened, so a script can rely on them: 0 applied (or read), 1 anything
rejected or needing a restart, or no engine answering (with the reason on stderr), 2 a usage
error caught before anything was sent.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from telemetry.control import ControlClient, ControlError
from telemetry.endpoints import DEFAULT_CONTROL

TIMEOUT_S = 5.0


def parse_pairs(pairs: list[str]) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; values stay strings (the engine coerces).
    Dashes in keys become underscores, matching the CLI flags' spelling."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        values[key] = raw.strip()
    return values


def _client(args: argparse.Namespace) -> ControlClient:
    return ControlClient(getattr(args, "control", None) or DEFAULT_CONTROL,
                         timeout_s=getattr(args, "timeout", None) or TIMEOUT_S)


def _fail(cmd: str, e: Exception) -> int:
    print(f"vconsole {cmd}: {e}", file=sys.stderr)
    return 1


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    return str(value).lower() if isinstance(value, bool) else str(value)


def main_set(args: argparse.Namespace) -> int:
    try:
        values = parse_pairs(args.pairs)
    except ValueError as e:
        print(f"vconsole set: {e}", file=sys.stderr)
        return 2
    try:
        with _client(args) as client:
            reply = client.set_config(values)
    except (TimeoutError, ControlError) as e:
        return _fail("set", e)
    applied, rejected = reply.get("applied", {}), reply.get("rejected", {})
    restart = reply.get("restart_required", [])
    for key, value in applied.items():
        print(f"applied  {key} = {_show(value)}")
    unchanged = [k for k in values if k not in applied and k not in rejected and k not in restart]
    if reply.get("ok") and unchanged:
        print(f"unchanged  {', '.join(unchanged)} (already set)")
    for key, why in rejected.items():
        print(f"rejected  {key}: {why}", file=sys.stderr)
    for key in restart:
        print(f"restart required  {key}: restart-only; restart the engine with the new value",
              file=sys.stderr)
    if not reply.get("ok"):
        print("nothing was applied (a change is all-or-nothing)", file=sys.stderr)
        return 1
    print(f"config version {reply.get('version')}")
    return 0


def main_get(args: argparse.Namespace) -> int:
    try:
        with _client(args) as client:
            reply = client.get_config()
    except (TimeoutError, ControlError) as e:
        return _fail("get", e)
    values: dict[str, Any] = reply.get("values", {})
    hot = {row["key"]: row["hot"] for row in reply.get("schema", [])}
    keys = [k.replace("-", "_") for k in (args.keys or [])] or list(values)
    unknown = [k for k in keys if k not in values]
    if unknown:
        print(f"vconsole get: unknown key(s): {', '.join(unknown)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"version": reply.get("version"),
                          "values": {k: values[k] for k in keys}}, indent=2))
        return 0
    width = max(len(k) for k in keys)
    vwidth = max(len(_show(values[k])) for k in keys)
    print(f"{'KEY':<{width}}  {'VALUE':<{vwidth}}  KIND")
    for key in keys:
        print(f"{key:<{width}}  {_show(values[key]):<{vwidth}}  "
              f"{'hot' if hot.get(key) else 'restart'}")
    print(f"(config version {reply.get('version')})")
    return 0
