"""`vconsole attach` and `vconsole replay`'s parsers (their handlers: `vconsole.commands.attach`).
Light imports only: `vconsole --help` loads it."""

from __future__ import annotations

import argparse

from vconsole.commands.flags import add_client_args, port
from vconsole.commands.subcommand import SubParsers, add_command


def add_parsers(subparsers: SubParsers) -> None:
    p = add_command(subparsers, "attach", "vconsole.commands.attach:main",
                    "attach the console to a running engine")
    add_client_args(p, control_key=True, vllm=True)
    p.add_argument("--extra-telemetry", action="append", default=[], metavar="ENDPOINT",
                   help="another engine's telemetry endpoint (e.g. a data-parallel rank)")
    p.add_argument("--readonly", action="store_true", help="watch only: hide every action")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="with --vllm: follow the server's KV events (its --kv-events-config "
                        "endpoint, e.g. tcp://127.0.0.1:5557; rank r on port + r) and show the "
                        "prefix cache's contents")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT",
                   help="with --kv-events: the server's replay endpoint, to catch up a gap")
    add_target_args(p, prometheus=True)
    g = p.add_argument_group("web (the console in a browser: one console process per tab)")
    g.add_argument("--web", action="store_true",
                   help="serve this console to browsers (textual-serve) instead of running it "
                        "here; prints the URLs, one with a token for tabs that may steer")
    g.add_argument("--host", metavar="HOST",
                   help="with --web: the address (default 127.0.0.1; beyond loopback every tab "
                        "needs the token)")
    g.add_argument("--port", type=port, metavar="PORT",
                   help="with --web: the port (default 8765; 0: a free one)")
    g.add_argument("--no-token", action="store_true",
                   help="with --web: no token, every tab read-only (loopback only)")

    p = add_command(subparsers, "replay", "vconsole.commands.attach:main_replay",
                    "play a recorded stream in the console")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--speed", type=float, default=1.0, help="playback speed (default 1.0)")


def add_target_args(p: argparse.ArgumentParser, *, prometheus: bool = False) -> None:
    g = p.add_argument_group("fleet (several engines of any kind; the Fleet screen first)")
    g.add_argument("--target", action="append", default=[], metavar="KIND=URL",
                   help="an engine to watch (repeatable): KIND is vconsole (tcp://HOST:BASE_PORT)"
                        ", vllm, sglang, llama-cpp (http://HOST:PORT) or auto (detected)")
    g.add_argument("--fleet", metavar="FILE",
                   help="a TOML file of [[engine]] tables: name, kind, url, kv_events, labels "
                        "(docs/fleet.md)")
    g.add_argument("--discover", action="append", default=[], metavar="HOST:PORT-PORT",
                   help="probe these ports for engines (an HTTP /metrics of a known kind, or our "
                        "engine's telemetry); a port that answers nothing known is skipped and "
                        "reported")
    if not prometheus:
        return
    g.add_argument("--prometheus", metavar="URL",
                   help="read the fleet from this Prometheus's query API (http://HOST:9090) "
                        "instead of scraping every server: a row per instance and engine")
    g.add_argument("--selector", metavar="SELECTOR",
                   help="with --prometheus: only these series, e.g. '{job=\"vllm\"}'")
