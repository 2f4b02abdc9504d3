"""The Fleet screen's pictures: a console on a live fleet, at 80x24 and 120x40, and drilled into
each target's Overview at 80x24.

    .venv/bin/python scripts/fleet_screenshots.py --fleet fleet.toml

The targets must be running (docs/fleet.md says how to point the console at each kind). The
pictures are written to screenshots/: fleet-80x24.svg, fleet-120x40.svg and
fleet-drill-NAME-80x24.svg.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from vconsole.console.app import VConsoleApp
from vconsole.console.screens.fleet import FleetScreen
from vconsole.console.sources.fleet.rows import Fleet
from vconsole.console.sources.fleet.snapshot import build_sources
from vconsole.console.sources.fleet.targets import load_fleet

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((80, 24), (120, 40))


def make_app(fleet_file: str) -> VConsoleApp:
    sources, problems = build_sources(load_fleet(fleet_file))
    if problems:
        raise SystemExit("; ".join(problems))
    return VConsoleApp(sources=sources, fleet=Fleet(sources, started=time.time()))


def settled(app: VConsoleApp) -> bool:
    screen = app.screen
    return isinstance(screen, FleetScreen) and bool(screen.rows) and all(
        r.state == "up" and r.gen_tok_s is not None for r in screen.rows.values())


async def shoot(fleet_file: str, out: Path, warmup_s: float) -> list[str]:
    saved = []
    app = make_app(fleet_file)
    async with app.run_test(size=SIZES[0]) as pilot:
        deadline = time.monotonic() + 60
        while not settled(app) and time.monotonic() < deadline:
            await pilot.pause(0.2)
        if not settled(app):
            raise SystemExit("not every target is up with two readings; are they running?")
        await pilot.pause(warmup_s)
        for width, height in SIZES:
            await pilot.resize_terminal(width, height)
            await pilot.pause(1.0)
            app.refresh_view(force=True)
            await pilot.pause()
            saved.append(app.save_screenshot(f"fleet-{width}x{height}.svg", str(out)))
        await pilot.resize_terminal(*SIZES[0])
        await pilot.pause(0.5)
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        for name in list(screen.row_keys):
            screen.table.move_cursor(row=screen.row_keys.index(name))
            await pilot.press("enter")
            await pilot.pause(1.5)
            saved.append(app.save_screenshot(f"fleet-drill-{name}-80x24.svg", str(out)))
            await pilot.press("escape")
            await pilot.pause(0.5)
            screen = app.screen
            assert isinstance(screen, FleetScreen)
    return saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", required=True, metavar="FILE", help="the fleet file (TOML)")
    p.add_argument("--warmup", type=float, default=8.0,
                   help="seconds of history before the pictures (default 8)")
    p.add_argument("--out", default=str(ROOT / "screenshots"))
    args = p.parse_args()
    for path in asyncio.run(shoot(args.fleet, Path(args.out), args.warmup)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
