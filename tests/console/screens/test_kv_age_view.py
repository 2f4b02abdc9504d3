"""The KV screen's age view (``A``) against real engines at 80x24: with --kv-cache-metrics the
map is coloured by the time since each block was last touched, the legend counts blocks per age
band and the three residency distributions sit under the map, each figure the one the engine
sent; without it the screen says how to turn it on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from textual.widgets import Static

from support.console_testing import until
from support.live_engine import ipc_endpoints
from vconsole.console.app import VConsoleApp
from vconsole.console.screens.kvmap import KvScreen
from vconsole.console.widgets.kv_grid import AGE_LABELS, KvGrid, age_counts
from vconsole.console.widgets.kv_residency import FIGURES, OFF, percentiles, seconds
from vconsole.engine.client.client import EngineClient
from vconsole.engine.launch.engine_process import EngineProcess

pytestmark = [pytest.mark.proc, pytest.mark.slow]

ARGS = ["--model", "tiny", "--num-kv-blocks", "8", "--block-size", "8", "--max-num-seqs", "1",
        "--kv-cache-metrics", "--kv-cache-metrics-sample", "1",
        "--set", "telemetry_hz=20", "--set", "heartbeat_interval_s=0.2"]


def serve(proc: EngineProcess) -> None:
    """Six requests of 10 prompt tokens, one at a time, on 8 blocks of 8: the 5th and 6th evict
    blocks the first ones left cached; then the first prompt again, a prefix hit (a reuse)."""
    with EngineClient(proc.endpoints["input"], proc.endpoints["output"]) as c:
        for i in [*range(6), 5]:
            c.submit(prompt_token_ids=[30 + 10 * i + j for j in range(10)], max_tokens=3,
                     ignore_eos=True)
            c.gather(timeout_s=60)


def text_of(widget: Static) -> str:
    return str(widget.render())


@pytest.fixture(scope="module")
def metrics_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv-age")
    with EngineProcess(ARGS, endpoints=ipc_endpoints(d), log_path=d / "engine.log") as proc:
        yield proc


async def test_the_age_view_shows_the_block_ages_and_distributions_the_engine_sent(
        metrics_engine):
    await asyncio.to_thread(serve, metrics_engine)
    app = VConsoleApp(telemetry_endpoints=[metrics_engine.endpoints["telemetry"]])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        await until(pilot, lambda: isinstance(app.screen, KvScreen))
        screen = app.screen
        assert isinstance(screen, KvScreen)
        eng = app.state.engines[next(iter(app.state.engines))]

        def arrived() -> bool:
            step = eng.latest.get("step") or {}
            res = step.get("kv_residency") or {}
            return (eng.block_age_s is not None and eng.block_states is not None
                    and (res.get("lifetime_s") or {}).get("count", 0) >= 2)
        await until(pilot, arrived, timeout=30)
        await pilot.press("p")                      # freeze the screen on one snapshot
        await pilot.press("A")
        await pilot.pause()
        grid = screen.query_one(KvGrid)
        assert grid.showing_ages
        states, ages = grid.states, grid.ages
        assert ages is not None and len(ages) == len(states) == 8
        legend = text_of(screen.query_one("#kv-legend", Static))
        bands = age_counts(states, ages)
        assert sum(bands) == int((states != 0).sum()) > 0      # the cached blocks at least
        for label, n in zip(AGE_LABELS, bands, strict=True):
            assert f"{label} {n:,}" in legend
        res = eng.latest["step"]["kv_residency"]
        table = text_of(screen.query_one("#kv-residency", Static)).splitlines()
        assert table[0].startswith("block residency")
        for (key, label), line in zip(FIGURES, table[1:], strict=True):
            hist = res[key]
            want = [f"{hist['count']:,}", *(seconds(p) for p in percentiles(hist))]
            assert line.startswith(label)
            assert line[len(label):].split()[:4] == want, (line, want)
        assert res["lifetime_s"]["count"] >= 2 and res["reuse_gap_s"]["count"] >= 0
        await pilot.press("p")                      # live again: the engine is idle, sends
        await until(pilot, lambda: grid.ages is not None       # no new ages, and they grow
                    and float(np.nanmin(np.where(grid.states != 0, grid.ages, np.nan))) >= 1.5,
                    timeout=10)
        await pilot.pause()
        assert "<1s 0 " in text_of(screen.query_one("#kv-legend", Static))
        await pilot.press("A")                      # back to the states
        await pilot.pause()
        assert not grid.showing_ages
        assert not screen.query_one("#kv-residency", Static).display
        assert "used" in text_of(screen.query_one("#kv-legend", Static))


async def test_without_kv_cache_metrics_the_age_view_says_how_to_turn_it_on(shared_engine):
    app = VConsoleApp(telemetry_endpoints=[shared_engine.endpoints["telemetry"]])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        await until(pilot, lambda: isinstance(app.screen, KvScreen))
        await until(pilot, lambda: any(e.block_states is not None
                                       for e in app.state.engines.values()), timeout=30)
        await pilot.press("A")
        await pilot.pause()
        await until(pilot, lambda: OFF in text_of(app.screen.query_one("#kv-residency", Static)),
                    timeout=10)
        assert "--kv-cache-metrics" in text_of(app.screen.query_one("#kv-legend", Static))
        assert not app.screen.query_one(KvGrid).showing_ages
