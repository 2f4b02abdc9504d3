"""`vconsole attach` and `vconsole replay`: start the console on live endpoints or a file, or
serve it to browsers (`vconsole attach --web`, `vconsole.console.web`)."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vconsole.commands import fail
from vconsole.commands.attach_targets import has_targets, targets_from
from vconsole.commands.curve_args import client_curve
from vconsole.security.curve import CurveKeyError
from vconsole.security.endpoints import DEFAULT_CONTROL, DEFAULT_TELEMETRY

if TYPE_CHECKING:
    from vconsole.console.sources.fleet.rows import Fleet
    from vconsole.console.sources.stream import ReplaySource
    from vconsole.console.sources.vllm import VllmSource


def main(args: argparse.Namespace) -> int:
    """Attach to a running engine (plus any extra telemetry endpoints, e.g. DP ranks)."""
    if getattr(args, "web", False):
        return _attach_web(args)
    web_flags = [flag for flag, given in (
        ("--host", getattr(args, "host", None) is not None),
        ("--port", getattr(args, "port", None) is not None),
        ("--no-token", bool(getattr(args, "no_token", False)))) if given]
    if web_flags:
        return fail("attach", f"{', '.join(web_flags)}: only with --web", 2)
    if has_targets(args):
        return _attach_fleet(args)
    if getattr(args, "vllm", None):
        return _attach_vllm(args)
    from vconsole.console.app import VConsoleApp

    try:
        curve = client_curve(args)
    except CurveKeyError as e:
        return fail("attach", e, 2)
    endpoints = [getattr(args, "telemetry", None) or DEFAULT_TELEMETRY,
                 *(getattr(args, "extra_telemetry", None) or [])]
    control = getattr(args, "control", None) or DEFAULT_CONTROL
    # Without the engine's control key (same machine: found by the endpoint) it is read-only.
    app = VConsoleApp(telemetry_endpoints=endpoints, control_endpoint=control,
                      readonly=bool(getattr(args, "readonly", False)),
                      control_key_file=getattr(args, "control_key_file", None), curve=curve)
    app.run()
    return 0


def _vllm_source(args: argparse.Namespace) -> VllmSource:
    """The `VllmSource` the flags name (nothing is contacted yet); ValueError saying what is
    wrong with ``--vllm`` or a ``--kv-events*`` endpoint."""
    from vconsole.console.sources.vllm import VllmSource
    from vconsole.telemetry.kv_wire import offset_endpoint

    for flag in ("kv_events", "kv_events_replay"):
        ep = getattr(args, flag, None)
        if ep:
            try:
                offset_endpoint(ep, 1)   # rank r listens on port + r: it needs a port
            except ValueError as e:
                raise ValueError(f"--{flag.replace('_', '-')}: {e}") from None
    try:
        return VllmSource(args.vllm, kv_events=getattr(args, "kv_events", None),
                          kv_events_replay=getattr(args, "kv_events_replay", None))
    except ValueError as e:
        raise ValueError(f"--vllm: {e}") from None


def _attach_vllm(args: argparse.Namespace) -> int:
    from vconsole.console.app import VConsoleApp

    try:
        source = _vllm_source(args)
    except ValueError as e:
        return fail("attach", e, 2)
    VConsoleApp(source=source, readonly=bool(getattr(args, "readonly", False))).run()
    return 0


def _attach_fleet(args: argparse.Namespace) -> int:
    """The console on every target the fleet flags name: the Fleet screen first."""
    import time

    from vconsole.console.app import VConsoleApp
    from vconsole.console.sources.fleet.rows import Fleet
    from vconsole.console.sources.fleet.snapshot import build_sources
    from vconsole.console.sources.fleet.targets import TargetError

    if getattr(args, "prometheus", None) or getattr(args, "selector", None):
        return _attach_prometheus(args)
    try:
        targets = targets_from(args)
    except TargetError as e:
        return fail("attach", e, 2)
    sources, problems = build_sources(targets)
    for line in problems:
        print(f"vconsole attach: left out {line}", file=sys.stderr)
    if not sources:
        return fail("attach", "no target could be used", 1)
    fleet = Fleet(sources, started=time.time())
    VConsoleApp(sources=sources, fleet=fleet,
                readonly=bool(getattr(args, "readonly", False))).run()
    return 0


def _attach_prometheus(args: argparse.Namespace) -> int:
    """The Fleet screen from Prometheus's query API (`vconsole.console.sources.fleet.
    prometheus_rows`); Prometheus down is the console's banner, not an error here."""
    import time

    from vconsole.commands.attach_targets import prometheus_source
    from vconsole.console.app import VConsoleApp
    from vconsole.console.sources.fleet.prometheus_rows import PrometheusFleet
    from vconsole.console.sources.fleet.targets import TargetError

    try:
        source = prometheus_source(args)
    except TargetError as e:
        return fail("attach", e, 2)
    fleet = PrometheusFleet(source, started=time.time())
    VConsoleApp(sources=[source], fleet=fleet,  # type: ignore[arg-type]
                readonly=bool(getattr(args, "readonly", False))).run()
    return 0


def console_argv(args: argparse.Namespace) -> list[str]:
    """The `vconsole attach` command line a browser tab runs: this command's own way to the
    engine (endpoints already resolved, key and CURVE files as absolute paths), no --web."""
    argv = [sys.executable, "-m", "vconsole", "attach"]
    if getattr(args, "prometheus", None):
        argv += ["--prometheus", args.prometheus]
        if getattr(args, "selector", None):
            argv += ["--selector", args.selector]
    elif getattr(args, "vllm", None):
        argv += ["--vllm", args.vllm]
        for flag in ("kv_events", "kv_events_replay"):
            if getattr(args, flag, None):
                argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    else:
        argv += ["--telemetry", getattr(args, "telemetry", None) or DEFAULT_TELEMETRY,
                 "--control", getattr(args, "control", None) or DEFAULT_CONTROL]
        for ep in getattr(args, "extra_telemetry", None) or []:
            argv += ["--extra-telemetry", ep]
        for flag in ("control_key_file", "curve_server_public", "curve_client_key"):
            if getattr(args, flag, None):
                argv += [f"--{flag.replace('_', '-')}", os.path.abspath(getattr(args, flag))]
    if getattr(args, "readonly", False):
        argv.append("--readonly")
    return argv


def _attach_web(args: argparse.Namespace) -> int:
    """Serve the console to browsers until Ctrl+C; print the one line with the token."""
    try:
        from vconsole.console.web import DEFAULT_HOST, DEFAULT_PORT, WebConsole
    except ModuleNotFoundError as e:
        return fail("attach", f"--web needs textual-serve ({e.name} is missing): "
                              "pip install 'vconsole[web]'", 2)
    from vconsole.security.bind_policy import RemoteBindRefused

    # A wrong flag is said once, here, not by every tab's console as it dies.
    if getattr(args, "prometheus", None) or getattr(args, "selector", None):
        from vconsole.commands.attach_targets import prometheus_source
        from vconsole.console.sources.fleet.targets import TargetError

        try:
            prometheus_source(args)
        except TargetError as e:
            return fail("attach", e, 2)
    elif getattr(args, "vllm", None):
        try:
            _vllm_source(args)           # built and dropped: the tabs' consoles build their own
        except ValueError as e:
            return fail("attach", e, 2)
    else:
        try:
            client_curve(args)
        except CurveKeyError as e:
            return fail("attach", e, 2)
    host = getattr(args, "host", None) or DEFAULT_HOST
    port = DEFAULT_PORT if getattr(args, "port", None) is None else args.port
    token = None if getattr(args, "no_token", False) else secrets.token_urlsafe(24)
    try:
        server = WebConsole(console_argv(args), host=host, port=port, token=token,
                            title="vconsole attach")
    except RemoteBindRefused as e:
        return fail("attach", e, 2)

    def ready(bound_host: str, bound_port: int) -> None:
        for line in _web_banner(args, server.loopback, bound_host, bound_port, token):
            print(line, flush=True)

    try:
        server.serve_until_stopped(ready)
    except OSError as e:
        return fail("attach", f"--web: cannot serve on {host}:{port}: {e}", 1)
    return 0


def _web_banner(args: argparse.Namespace, loopback: bool, host: str, port: int,
                token: str | None) -> list[str]:
    """What the operator needs at start: the URLs, who may steer and why (the token's only
    appearance anywhere)."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()     # a name the team can reach, not 0.0.0.0
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    lines = [f"vconsole attach --web: the console on {base} (one console per browser tab; "
             "Ctrl+C stops)"]
    if loopback:
        lines.append(f"  read-only tab:  {base}")
    else:
        lines.append("  beyond loopback every tab needs the token; plain HTTP: the token and "
                     "the screen cross the network in clear (prefer an SSH tunnel)")
    if token is not None:
        lines.append(f"  steering tab:   {base}?token={token}   ({_steering_note(args)})")
    else:
        lines.append("  --no-token: every tab is read-only")
    return lines


def _steering_note(args: argparse.Namespace) -> str:
    """Whether a tab opened with the token can change the config, as its console will find."""
    if getattr(args, "readonly", False):
        return "--readonly: read-only too"
    if getattr(args, "vllm", None):
        return "a vLLM server's actions"
    from vconsole.security.control_key import control_key_file, load_control_key

    control = getattr(args, "control", None) or DEFAULT_CONTROL
    path = control_key_file(control, getattr(args, "control_key_file", None))
    if load_control_key(control, path) is None:
        return f"read-only until the engine's control key is readable here: {path}"
    return "this side holds the engine's control key: it can change the config"


def main_replay(args: argparse.Namespace) -> int:
    """Drive the console from a recorded file at ``--speed`` (read-only)."""
    from vconsole.console.app import VConsoleApp
    from vconsole.console.sources.stream import ReplaySource
    from vconsole.telemetry.record import RecordFormatError, read_header

    path = Path(args.file)
    try:
        with open(path, "rb") as fh:
            read_header(fh)
    except (OSError, RecordFormatError) as e:
        return fail("replay", e, 2)
    speed = float(getattr(args, "speed", 1.0) or 1.0)
    source = ReplaySource(path, speed=speed)
    app = VConsoleApp(source=source, fleet=_recorded_fleet(path, source))
    app.run()
    return 0


def _recorded_fleet(path: Path, source: ReplaySource) -> Fleet | None:
    """A recording of several engines (`vconsole record --fleet`): their rows, so the replay
    opens on the Fleet screen; None for one engine or one data-parallel group."""
    from vconsole.console.sources.fleet.recording import RecordedSource, recorded_targets
    from vconsole.console.sources.fleet.rows import Fleet

    targets, first = recorded_targets(path)
    if len(targets) < 2:
        return None
    return Fleet([RecordedSource(t, source) for t in targets], started=first)
