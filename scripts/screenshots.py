"""Save an SVG of every console screen into screenshots/.

Three ways to feed the console:

    .venv/bin/python scripts/screenshots.py                 # engine + load, started here
    .venv/bin/python scripts/screenshots.py --attach --telemetry EP --control EP
    .venv/bin/python scripts/screenshots.py --replay tests/data/synthetic.vrec
    .venv/bin/python scripts/screenshots.py --dp             # data parallel, synthetic only
    .venv/bin/python scripts/screenshots.py --vllm           # watching a vLLM server

The first starts what `vconsole demo` starts (`vconsole.tools.demo.DemoStack`: an engine process with
the demo's model — smollm2 when installed, publishing request text — on free loopback ports and a
bursty load), waits until every panel has data,
takes the pictures and stops both. Pictures: each screen at 120x40 and 80x24 (and the Requests
screen's detail pane), plus help and the config confirm box;
Trends over its 1-minute range, and at 80x24 also its latency page (TTFT, ITL). Meanwhile it
records the engine's telemetry (`vconsole record`) and then replays that recording into a fresh
console for ``overview-replay.svg`` and ``trends-replay.svg``: the same screens from a file.

``--dp`` takes only the data-parallel pictures, at 80x24, from a synthetic stream of 2 and of 8
ranks on one endpoint (tests/support/synthetic_dp.py `showcase`: light load, waves, then a burst
on rank 0 alone; of the 8, rank 5 dies halfway): ``ranks-2-80x24.svg``, ``ranks-8-80x24.svg`` (the Ranks screen) and
``overview-dp-80x24.svg`` (the Overview of the 2 ranks). The other pictures are left as they are.

``--vllm`` takes the pictures of a console watching a vLLM server with two engines: a server on
loopback whose ``/metrics`` are built as vLLM builds them (tests/support/vllm_metrics.py), under
steady load: ``overview-vllm-80x24.svg``, ``kv-vllm-80x24.svg``, ``ranks-vllm-80x24.svg``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDING = ROOT / "tests" / "data" / "synthetic.vrec"
sys.path.insert(0, str(ROOT))

from vconsole.console.app import VConsoleApp  # noqa: E402
from vconsole.console.sources.stream import ReplaySource  # noqa: E402

MODES = ("overview", "requests", "kv", "config", "trends", "alerts")
SIZES = ((120, 40), (80, 24))


def ready(app: VConsoleApp) -> bool:
    eng = app.state.engine()
    need = ("health", "step", "sched", "kv", "gpu", "host")
    return eng is not None and all(t in eng.latest for t in need) and \
        app.state.config is not None and finished_in_window(app)


def finished_in_window(app: VConsoleApp) -> bool:
    """The latency topic has percentiles to show (a request finished within its window);
    a recording from before the topic existed has none, and that is shown as it is."""
    eng = app.state.engine()
    lat = eng.latest.get("latency") if eng is not None else None
    if lat is None:
        return isinstance(app.sources[0], ReplaySource)
    e2e = ((lat.get("overall") or {}).get("window") or {}).get("e2e_s") or {}
    return bool(e2e.get("count"))


def busy(app: VConsoleApp) -> bool:
    eng = app.state.engine()
    return eng is not None and (eng.latest.get("sched", {}).get("num_running") or 0) >= 4


async def wait_busy(pilot, app: VConsoleApp, timeout_s: float) -> None:
    """The demo load comes in bursts; a picture of an idle engine shows little."""
    deadline = time.monotonic() + timeout_s
    while not busy(app) and time.monotonic() < deadline:
        await pilot.pause(0.2)


async def shoot(make_app, out: Path, warmup_s: float, timeout_s: float,
                detail: bool = False) -> list[str]:
    """One app (so the sparklines keep their history), resized between the sets; ``detail``:
    also the Requests screen's detail pane (a live engine publishing request text)."""
    saved = []
    app = make_app()
    async with app.run_test(size=SIZES[0]) as pilot:
        deadline = time.monotonic() + timeout_s
        while not ready(app) and time.monotonic() < deadline:
            await pilot.pause(0.2)
        if not ready(app):
            raise SystemExit("no complete telemetry in time; is the engine running?")
        await pilot.pause(warmup_s)
        for width, height in SIZES:
            await wait_busy(pilot, app, timeout_s)
            await pilot.resize_terminal(width, height)
            await pilot.pause(0.3)
            suffix = "" if (width, height) == SIZES[0] else f"-{width}x{height}"
            for mode in MODES:
                app.action_show(mode)
                await pilot.pause(0.5)
                if mode == "trends":
                    app.screen.action_set_range(0)      # the last minute: the demo is young
                    await pilot.pause(0.3)
                await wait_busy(pilot, app, timeout_s)
                app.refresh_view(force=True)
                await pilot.pause()
                saved.append(app.save_screenshot(f"{mode}{suffix}.svg", str(out)))
                if mode == "requests" and detail:
                    await pilot.press("enter")          # the detail pane of the first row
                    await pilot.pause(1.0)
                    saved.append(app.save_screenshot(f"requests-detail{suffix}.svg", str(out)))
                    await pilot.press("escape")
                if mode == "trends" and app.screen.pages > 1:
                    app.screen.action_page(app.screen.pages - 1 - app.screen.page)
                    await pilot.pause(0.3)
                    saved.append(app.save_screenshot(f"trends-latency{suffix}.svg", str(out)))
                    app.screen.action_page(1)
        await pilot.resize_terminal(*SIZES[0])
        await pilot.press("question_mark")
        await pilot.pause(0.3)
        saved.append(app.save_screenshot("help.svg", str(out)))
        await pilot.press("escape")
        if not app.readonly:
            app.action_show("config")
            await pilot.pause(0.3)
            app.request_change("max_num_seqs", "1")
            await pilot.pause(0.3)
            saved.append(app.save_screenshot("confirm.svg", str(out)))
            await pilot.press("escape")
    return saved


async def shoot_replay(recording: Path, out: Path, speed: float = 10.0) -> list[str]:
    """The Overview and Trends of a replayed recording, once it has played to its end."""
    app = VConsoleApp(source=ReplaySource(recording, speed=speed))
    saved = []
    async with app.run_test(size=SIZES[0]) as pilot:
        source = app.sources[0]
        deadline = time.monotonic() + 120.0
        while not getattr(source, "finished", False) and time.monotonic() < deadline:
            await pilot.pause(0.5)
        for mode, name in (("overview", "overview-replay.svg"), ("trends", "trends-replay.svg")):
            app.action_show(mode)
            await pilot.pause(0.5)
            if mode == "trends":
                app.screen.action_set_range(0)
                await pilot.pause(0.3)
            app.refresh_view(force=True)
            await pilot.pause()
            saved.append(app.save_screenshot(name, str(out)))
    return saved


async def shoot_dp(out: Path) -> list[str]:
    """The Ranks screen of a synthetic 2-rank and 8-rank group, and the 2 ranks' Overview."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.synthetic_dp import showcase

    saved = []
    for n, stop in ((2, None), (8, (5, 0.5))):
        records = list(showcase(n, 30.0, stop_rank=stop))
        app = VConsoleApp(source=ReplaySource(f"synthetic-{n}-ranks", speed=0,
                                              records=lambda r=records: iter(r)))
        async with app.run_test(size=SIZES[1]) as pilot:
            await pilot.pause(0.3)
            if n == 2:
                app.refresh_view(force=True)
                await pilot.pause()
                saved.append(app.save_screenshot("overview-dp-80x24.svg", str(out)))
            app.action_show("dp")
            await pilot.pause(0.3)
            app.refresh_view(force=True)
            await pilot.pause()
            saved.append(app.save_screenshot(f"ranks-{n}-80x24.svg", str(out)))
    return saved


async def shoot_vllm(out: Path) -> list[str]:
    """A console on a vLLM-shaped /metrics of two engines, after ten seconds of load."""
    import random
    import threading

    sys.path.insert(0, str(ROOT / "tests"))
    from support.vllm_metrics import VllmMetrics
    from vconsole.console.sources.vllm import VllmSource

    metrics = VllmMetrics(engines=2)
    url = metrics.serve()
    stop = threading.Event()

    def load() -> None:
        rng = random.Random(1)
        while not stop.wait(0.25):
            for e, scale in (("0", 1.0), ("1", 0.6)):
                metrics.step(e, running=int(24 * scale) + rng.randrange(4),
                             waiting=rng.randrange(int(12 * scale) + 1),
                             usage=0.55 * scale + rng.random() * 0.1,
                             prompt=int(900 * scale), generation=int(300 * scale),
                             finished=rng.randrange(3, 6), steps=30,
                             ttft=0.04 + rng.random() * 0.2, itl=0.015 + rng.random() * 0.02)
    feeder = threading.Thread(target=load, daemon=True)
    feeder.start()
    saved = []
    try:
        app = VConsoleApp(source=VllmSource(url, interval_s=0.5, local_gpu=False))
        async with app.run_test(size=SIZES[1]) as pilot:
            await pilot.pause(10.0)
            for mode, name in (("overview", "overview-vllm"), ("kv", "kv-vllm"),
                               ("dp", "ranks-vllm")):
                app.action_show(mode)
                await pilot.pause(0.5)
                app.refresh_view(force=True)
                await pilot.pause()
                saved.append(app.save_screenshot(f"{name}-80x24.svg", str(out)))
    finally:
        stop.set()
        metrics.close()
    return saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--replay", metavar="FILE", nargs="?", const=str(RECORDING),
                   help=f"drive the console from a recording (default {RECORDING.name})")
    g.add_argument("--attach", action="store_true", help="attach to a running engine")
    g.add_argument("--dp", action="store_true",
                   help="only the data-parallel pictures, from synthetic 2- and 8-rank streams")
    g.add_argument("--vllm", action="store_true",
                   help="only the pictures of a console watching a vLLM server")
    p.add_argument("--telemetry", default="tcp://127.0.0.1:5572")
    p.add_argument("--control", default="tcp://127.0.0.1:5573")
    p.add_argument("--rate", type=float, default=None,
                   help="load: mean requests per second (default: the demo's for its model)")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds of live data before the pictures (sparklines fill up)")
    p.add_argument("--out", default=str(ROOT / "screenshots"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.dp:
        saved = asyncio.run(shoot_dp(out))
    elif args.vllm:
        saved = asyncio.run(shoot_vllm(out))
    elif args.replay:
        saved = asyncio.run(shoot(lambda: VConsoleApp(source=ReplaySource(args.replay, speed=0)),
                                  out, 0.0, 5.0))
    elif args.attach:
        saved = asyncio.run(shoot(lambda: VConsoleApp([args.telemetry], args.control), out,
                                  args.warmup, 30.0))
    else:
        import tempfile
        import threading

        from vconsole.cli import build_parser
        from vconsole.commands.demo import engine_args_from
        from vconsole.telemetry.record import record_stream
        from vconsole.tools.demo import DemoStack, demo_model, prepare_model
        from vconsole.wire.control_client import ControlClient

        # What `vconsole demo` runs: smollm2 when installed (request text on), else tiny.
        model = demo_model()
        prepare_model(model, print)
        engine_args = engine_args_from(build_parser().parse_args(["demo"]), model)
        recording = Path(tempfile.mkdtemp(prefix="vconsole-shots-")) / "demo.vrec"
        with DemoStack(engine_args, rate=args.rate or model.rate) as stack:
            eps = stack.endpoints
            key, control_key_file = stack.engine.control_key(), stack.engine.control_key_file
            # Waiting-queue thresholds the demo's bursts cross, so the Alerts screen shows
            # real alerts of this engine (at the defaults, 50 / 100, a demo raises none).
            with ControlClient(eps["control"], key=key) as ctl:
                ctl.set_config({"alert_waiting_warning": 4, "alert_waiting_critical": 12})
            recorder = threading.Thread(target=record_stream, daemon=True, args=(
                eps["telemetry"], recording, args.warmup + 45.0))
            recorder.start()
            saved = asyncio.run(shoot(lambda: VConsoleApp([eps["telemetry"]], eps["control"],
                                                          control_key=key,
                                                          control_key_file=control_key_file),
                                      out, args.warmup, 60.0, detail=True))
            recorder.join()
        saved += asyncio.run(shoot_replay(recording, out))
    for path in saved:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
