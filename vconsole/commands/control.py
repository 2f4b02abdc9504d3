"""`vconsole set KEY=VALUE ...` and `vconsole get [KEY ...]`: the control channel for scripts.

Exit codes say what happened, so a script can rely on them: 0 applied (or read), 1 anything
rejected or needing a restart, no engine answering, or no control key (with the reason on
stderr), 2 a usage error caught before anything was sent.

`set` needs the engine's control key (`vconsole.security.control_key`): read from ``--control-key-file``
or the path derived from ``--control``; `get` sends it when it is there but needs none.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vconsole.commands import fail
from vconsole.commands.curve_args import client_curve
from vconsole.console.sources.fleet.control import parse_pairs  # KEY=VALUE, as --fleet's
from vconsole.security import control_key, key_owner
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULT_CONTROL
from vconsole.wire.control import ControlError
from vconsole.wire.control_client import ControlClient

TIMEOUT_S = 5.0
PROBE_S = 1.5       # is any engine there at all (when the control key is missing)


def _endpoint(args: argparse.Namespace) -> str:
    return getattr(args, "control", None) or DEFAULT_CONTROL


def _client(args: argparse.Namespace, key: str | None = None) -> ControlClient:
    return ControlClient(_endpoint(args), timeout_s=getattr(args, "timeout", None) or TIMEOUT_S,
                         key=key, curve=client_curve(args))


class StaleKeyError(ControlError):
    """The key file was left by an engine that no longer runs."""


def _engine_answers(args: argparse.Namespace) -> bool:
    """Whether an engine answers ``get_config`` (which needs no key) within `PROBE_S`."""
    try:
        with ControlClient(_endpoint(args), timeout_s=PROBE_S,
                           curve=client_curve(args)) as client:
            client.get_config()
    except (TimeoutError, ControlError, CurveKeyError):
        return False
    return True


def _read_key(args: argparse.Namespace) -> str:
    """The control key for `set`; raises ControlError naming the path and what to do, also when
    the key's owner record says its engine is gone (a file left by a killed engine). Without a
    usable key it first asks whether any engine answers: with none running, that is the
    error, not the key."""
    try:
        return _key_from_file(args)
    except ControlError as e:
        if _engine_answers(args):
            raise
        # A stale key says which engine is gone: keep that; a missing one says nothing more.
        why = f"; {e}" if isinstance(e, StaleKeyError) else ""
        raise ControlError(
            f"no engine answers on {_endpoint(args)}: start one (`vconsole engine`, or "
            f"`vconsole demo`), or pass the running engine's --control ENDPOINT{why}") from None


def _key_from_file(args: argparse.Namespace) -> str:
    path = control_key.control_key_file(_endpoint(args), getattr(args, "control_key_file", None))
    try:
        key = control_key.read_key_file(path)
    except (OSError, ValueError) as e:
        why = ("no such file" if isinstance(e, FileNotFoundError)
               else str(getattr(e, "strerror", None) or e))
        raise ControlError(
            f"cannot read the engine's control key {path} ({why}); changing the config needs "
            "it. The engine writes it at start: run this on the engine's machine as its user, "
            "copy the key file here, or pass --control-key-file PATH") from None
    found = key_owner.status(path, key)
    if found.state == key_owner.GONE:
        raise StaleKeyError(
            f"the control key in {path} belongs to {found.describe()}: that engine was stopped "
            "without cleaning up (killed?). Start the engine again (it replaces the stale file) "
            "or pass the running engine's --control-key-file PATH")
    return key


def _request(client: ControlClient, op: str, values: dict[str, Any] | None,
             rank: int | None) -> dict[str, Any]:
    """``client.set_config`` / ``get_config``, with ``rank`` (a data-parallel front end's
    addressee) when given. Raises ControlError on a reply that failed as a whole."""
    if rank is None:
        return client.set_config(values or {}) if op == "set_config" else client.get_config()
    reply = client.request(op, values, fields={"rank": rank})
    if not reply.get("ok") and reply.get("error"):
        raise ControlError(reply["error"])
    return reply


def _print_ranks(reply: dict[str, Any]) -> None:
    """A data-parallel front end's per-rank acknowledgements, one line each."""
    for rank, ack in sorted((reply.get("ranks") or {}).items()):
        state = "applied" if ack.get("ok") else f"refused: {ack.get('error') or 'rejected'}"
        print(f"rank {rank}  {state} (config version {ack.get('version')})")


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    return str(value).lower() if isinstance(value, bool) else str(value)


def main_set(args: argparse.Namespace) -> int:
    if getattr(args, "fleet", None):
        from vconsole.commands.control_fleet import main_set_fleet

        return main_set_fleet(args)
    try:
        values = parse_pairs(args.pairs)
    except ValueError as e:
        return fail("set", e, 2)
    try:
        key = _read_key(args)
        with _client(args, key) as client:
            reply = _request(client, "set_config", values, getattr(args, "rank", None))
    except CurveKeyError as e:
        return fail("set", e, 2)
    except (TimeoutError, ControlError) as e:
        return fail("set", e)
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
    _print_ranks(reply)
    if not reply.get("ok"):
        print("nothing was applied (a change is all-or-nothing)", file=sys.stderr)
        return 1
    print(f"config version {reply.get('version')}")
    return 0


def main_get(args: argparse.Namespace) -> int:
    path = control_key.control_key_file(_endpoint(args), getattr(args, "control_key_file", None))
    key = control_key.load_control_key(_endpoint(args), path)
    try:
        with _client(args, key) as client:
            reply = _request(client, "get_config", None, getattr(args, "rank", None))
    except CurveKeyError as e:
        return fail("get", e, 2)
    except TimeoutError as e:
        found = key_owner.status(path, key) if key else None
        gone = (f"; the control key file {path} was left by {found.describe()}"
                if found is not None and found.state == key_owner.GONE else "")
        return fail("get", f"{e}{gone}")
    except ControlError as e:
        return fail("get", e)
    values: dict[str, Any] = reply.get("values", {})
    hot = {row["key"]: row["hot"] for row in reply.get("schema", [])}
    keys = [k.replace("-", "_") for k in (args.keys or [])] or list(values)
    unknown = [k for k in keys if k not in values]
    if unknown:
        return fail("get", f"unknown key(s): {', '.join(unknown)}")
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
