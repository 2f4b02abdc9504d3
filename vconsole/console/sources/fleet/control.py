"""One config change for every engine of ours in a fleet: what `vconsole set --fleet` and the
Fleet screen's ``e`` share. Which engines it touches (`split`), the change itself
(`parse_pairs`) and each engine's answer (`set_one`: its own control socket and key, one
engine at a time). Other kinds are never sent anything: they are watched only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vconsole.console.sources.fleet.targets import CONTROL_OFFSET, Target, TargetError

TIMEOUT_S = 5.0


def parse_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``["a=1", "b=x"]`` → ``{"a": "1", "b": "x"}`` (dashes in keys become underscores, as
    `vconsole set`); ValueError for a pair without ``=``."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        values[key] = raw.strip()
    return values


def split(targets: Sequence[Target], *, resolve_auto: bool = True
          ) -> tuple[list[Target], list[tuple[Target, str]]]:
    """(our engines, the others with why they are not touched). An ``auto`` target at a
    ``tcp://`` URL is ours when our engine's telemetry answers there."""
    from vconsole.console.sources.fleet.detect import resolve

    ours: list[Target] = []
    others: list[tuple[Target, str]] = []
    for t in targets:
        if t.kind == "auto" and t.url.startswith("tcp://") and resolve_auto:
            try:
                t = resolve(t, timeout_s=2.0)
            except TargetError as e:
                others.append((t, f"not reached: {e}"))
                continue
        if t.kind == "vconsole":
            ours.append(t)
        else:
            others.append((t, f"{t.kind}: watched only"))
    return ours, others


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_one(target: Target, values: dict[str, str]) -> tuple[bool, list[str]]:
    """Send the change to one engine of ours: (applied, its answer's lines)."""
    import zmq

    from vconsole.security import control_key
    from vconsole.security.curve import CurveKeyError, load_client_curve
    from vconsole.wire.control import ControlError
    from vconsole.wire.control_client import ControlClient

    endpoint = target.endpoint(CONTROL_OFFSET)
    path = control_key.control_key_file(endpoint, target.control_key_file)
    try:
        key = control_key.read_key_file(path)
    except (OSError, ValueError):
        return False, [f"refused here: cannot read its control key {path} (give "
                       "control_key_file in the fleet file)"]
    try:
        curve = load_client_curve(target.curve.get("server_public"),
                                  target.curve.get("client_key")) if target.curve else None
        with ControlClient(endpoint, timeout_s=TIMEOUT_S, key=key, curve=curve) as client:
            reply: dict[str, Any] = client.set_config(values)
    except (TimeoutError, ControlError, CurveKeyError) as e:
        return False, [f"no answer: {e}"]
    except (zmq.ZMQError, ValueError, OSError) as e:   # a bad key or endpoint: this one only
        return False, [f"not sent: {type(e).__name__}: {e}"]
    lines = [f"applied  {k} = {_show(v)}" for k, v in (reply.get("applied") or {}).items()]
    lines += [f"rejected  {k}: {why}" for k, why in (reply.get("rejected") or {}).items()]
    lines += [f"restart required  {k}" for k in reply.get("restart_required") or []]
    if reply.get("ok"):
        lines.append(f"config version {reply.get('version')}")
    else:
        lines.append("nothing was applied (a change is all-or-nothing)")
    return bool(reply.get("ok")), lines
