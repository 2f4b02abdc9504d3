"""The Fleet screen (``F``, first with several targets) over live HTTP stand-ins of vLLM, SGLang
and llama.cpp (their own metric names) and one target that is not there: its rows show each
server's numbers, the fleet's row sums them, ``/`` filters, ``g`` groups by model, ``enter``
drills into one engine and ``esc`` comes back."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from textual.widgets import DataTable, Static

from support.console_testing import until
from support.http_standin import StandIn
from support.llama_cpp_stub import LlamaServerStub
from support.ports import free_block
from support.sglang_metrics import SglangMetrics
from support.vllm_metrics import VllmMetrics
from vconsole.console.app import VConsoleApp
from vconsole.console.screens.fleet import FleetScreen
from vconsole.console.sources.fleet.rows import Fleet
from vconsole.console.sources.fleet.snapshot import build_sources
from vconsole.console.sources.fleet.targets import make_target

pytestmark = pytest.mark.slow
PORTS = tuple(free_block(4) + i for i in range(4))   # the last: nothing listens


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[VllmMetrics, SglangMetrics, LlamaServerStub]]:
    vm = VllmMetrics(engines=1)
    vm.step("0", running=3, waiting=2, usage=0.4, prompt=100, generation=50, finished=4)
    sg = SglangMetrics(model="org/sg-model")
    sg.step(running=5, waiting=9, used_tokens=20_000, prompt=100, generation=50, finished=2)
    ll = LlamaServerStub(slots=2, n_ctx=1000)
    ll.busy(0, prompt=100, decoded=150)
    vs = StandIn(lambda p: (200, "text/plain", vm.text().encode()) if p == "/metrics"
                 else (404, "text/plain", b""))
    for server, port in zip((vs, sg, ll), PORTS, strict=False):
        server.serve(port)
    yield vm, sg, ll
    for server in (vs, sg, ll):
        server.close()


def fleet_app() -> VConsoleApp:
    targets = [make_target("vllm", f"127.0.0.1:{PORTS[0]}", name="vllm-a"),
               make_target("sglang", f"127.0.0.1:{PORTS[1]}", name="sglang-a"),
               make_target("llama-cpp", f"127.0.0.1:{PORTS[2]}", name="llama-a"),
               make_target("vllm", f"127.0.0.1:{PORTS[3]}", name="gone")]
    sources, problems = build_sources(targets)
    assert not problems
    return VConsoleApp(sources=sources, fleet=Fleet(sources, started=time.time()))


def cell(table: DataTable, row: str, column: str) -> str:
    return str(table.get_cell(row, column))


def text_of(screen: FleetScreen, widget_id: str) -> str:
    return str(screen.query_one(widget_id, Static).render())


async def settled(pilot, app: VConsoleApp) -> FleetScreen:
    def ready() -> bool:
        screen = app.screen
        if not isinstance(screen, FleetScreen) or len(screen.row_keys) != 4:
            return False
        table = screen.table
        return cell(table, "vllm-a", "tok") != "–" and cell(table, "gone", "state") \
            .startswith("down")
    await until(pilot, ready, timeout=15)
    assert isinstance(app.screen, FleetScreen)
    return app.screen


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_the_fleet_comes_first_with_each_servers_numbers(servers, size):
    app = fleet_app()
    async with app.run_test(size=size) as pilot:
        screen = await settled(pilot, app)
        t = screen.table
        assert (cell(t, "vllm-a", "running"), cell(t, "vllm-a", "waiting"),
                cell(t, "vllm-a", "kv")) == ("3", "2", "40%")
        assert (cell(t, "sglang-a", "running"), cell(t, "sglang-a", "waiting"),
                cell(t, "sglang-a", "kv")) == ("5", "9", "10%")
        assert cell(t, "llama-a", "kv") == "12%~"          # 250 of 2000 tokens, estimated
        assert cell(t, "llama-a", "ttft99") == "–"          # llama.cpp has no histograms
        summary = text_of(screen, "#fleet-summary")
        assert "3/4 up" in summary and "run 9 · wait 11" in summary
        hint = text_of(screen, "#fleet-hint")
        assert hint.startswith("llama-cpp, sglang, vllm: watched only")
        wide = size[0] >= 120
        assert ("model" in [str(c.key.value) for c in t.columns.values()]) is wide
        findings = text_of(screen, "#fleet-findings")
        assert "gone down for" in findings and "Connection refused" in findings


async def test_enter_drills_in_and_esc_comes_back(servers):
    app = fleet_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await settled(pilot, app)
        screen.table.move_cursor(row=screen.row_keys.index("sglang-a"))
        await pilot.press("enter")
        await until(pilot, lambda: app.current_mode == "overview")
        assert app.selected_engine == "sglang-a/0"
        assert app.current_engine() is not None and app.current_engine().engine == "sglang-a"
        await pilot.press("escape")
        await until(pilot, lambda: app.current_mode == "fleet")
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        screen.table.move_cursor(row=screen.row_keys.index("gone"))
        await pilot.press("enter")                  # nothing heard: it says so, stays here
        await pilot.pause(0.2)
        assert app.current_mode == "fleet"


async def test_filter_sort_and_group_by_model(servers):
    app = fleet_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await settled(pilot, app)
        await pilot.press("slash", *"kind:llama-cpp", "enter")
        await until(pilot, lambda: screen.row_keys == ["llama-a"])
        assert screen.filter_text == "kind:llama-cpp"
        await pilot.press("slash", *["ctrl+u"], *"waiting>0", "enter")
        await until(pilot, lambda: set(screen.row_keys) == {"vllm-a", "sglang-a"})
        await pilot.press("escape")                   # clears the filter
        await until(pilot, lambda: len(screen.row_keys) == 4)
        await pilot.press("s", "s", "s", "s")         # name → kind → state → running → waiting
        await until(pilot, lambda: screen.sort_key == "waiting")
        await until(pilot, lambda: screen.row_keys[:2] == ["sglang-a", "vllm-a"])
        await pilot.press("g")
        await until(pilot, lambda: "group:org/sg-model" in screen.row_keys)
        assert screen.row_keys[screen.row_keys.index("group:org/sg-model") + 1] == "sglang-a"


async def test_one_console_of_one_engine_has_no_fleet_screen(servers):
    sources, _ = build_sources([make_target("vllm", f"127.0.0.1:{PORTS[0]}", name="v")])
    app = VConsoleApp(sources=sources)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        assert app.current_mode == "overview"
        await pilot.press("F")
        await pilot.pause(0.2)
        assert app.current_mode == "overview"


async def test_esc_on_a_list_screen_with_no_filter_comes_back_to_the_fleet(servers):
    app = fleet_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await settled(pilot, app)
        screen.table.move_cursor(row=screen.row_keys.index("vllm-a"))
        await pilot.press("enter")
        await until(pilot, lambda: app.current_mode == "overview")
        for key in ("2", "4", "exclamation_mark"):     # Requests, Config, Alerts
            await pilot.press(key)
            await pilot.pause(0.1)
            await pilot.press("escape")
            await until(pilot, lambda: app.current_mode == "fleet")
            await pilot.press("enter")
            await until(pilot, lambda: app.current_mode == "overview")


async def test_the_fleets_findings_are_alerts_with_their_evidence(servers):
    app = fleet_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await settled(pilot, app)

        def named(name: str) -> list:
            return [a for a in app.state.alerts if a.name == name]
        await until(pilot, lambda: named("fleet down") and named("fleet queue_imbalance"),
                    timeout=10)
        down = named("fleet down")[0]
        assert (down.engine, down.level) == ("gone", "critical")
        assert "Connection refused" in down.message and "for_s" in down.message
        queue = named("fleet queue_imbalance")[0]
        assert queue.engine == "sglang-a" and "waiting 9" in queue.message
        assert ("gone/0", "fleet down") in app.state.active_alerts
        await pilot.press("exclamation_mark")
        await until(pilot, lambda: app.current_mode == "alerts")
        table = app.screen.query_one(DataTable)
        texts = [" ".join(str(c) for c in table.get_row_at(i)) for i in range(table.row_count)]
        assert any("fleet down" in t and "gone" in t for t in texts)


async def test_a_drilled_in_engine_shows_its_own_config(servers):
    app = fleet_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await settled(pilot, app)
        for name, key, value in (("llama-a", "total_slots", 2),
                                 ("vllm-a", "num_gpu_blocks", 1000),
                                 ("sglang-a", "max_total_num_tokens", 200_000)):
            if app.current_mode != "fleet":
                await pilot.press("escape")
                await until(pilot, lambda: app.current_mode == "fleet")
                screen = app.screen
            screen.table.move_cursor(row=screen.row_keys.index(name))
            await pilot.press("enter", "4")
            await until(pilot, lambda: app.current_mode == "config")
            await until(pilot, lambda key=key: app.state.config is not None
                        and key in app.state.config.values)
            assert app.state.config.values[key] == value
            assert app.state.primary == f"{name}/0"


async def test_the_advice_screen_says_what_to_do_about_each_fleet_finding(servers):
    # sglang-a waits 9 against a median of 2 while llama-a has none: a router problem; "gone"
    # answers nothing. Neither is one engine's config: the Advice screen says what to look at.
    app = fleet_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settled(pilot, app)
        await pilot.press("a")
        await until(pilot, lambda: app.current_mode == "advice")

        def fleet_text() -> str:
            return str(app.screen.query_one("#adv-fleet", Static).render())
        await until(pilot, lambda: "gone down" in fleet_text() and "sglang-a" in fleet_text())
        text = fleet_text()
        assert "sglang-a has 9 waiting (fleet median 2)" in text
        assert "balancing" in text and "take it out of the router" in text
        assert app.screen.query_one("#adv-fleet", Static).display


async def test_a_refresh_updates_only_the_cells_whose_text_changed(servers):
    vm = servers[0]
    app = fleet_app()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await settled(pilot, app)
        t = screen.table
        updated: list[tuple[str, str]] = []
        real = t.update_cell

        def counting(row_key, column_key, value, **kw):
            updated.append((str(row_key), str(column_key)))
            return real(row_key, column_key, value, **kw)

        t.update_cell = counting
        vm.step("0", running=7, waiting=2, usage=0.4)
        try:
            await until(pilot, lambda: cell(t, "vllm-a", "running") == "7", timeout=15)
        finally:
            vm.step("0", running=3, waiting=2, usage=0.4)
        assert ("vllm-a", "running") in updated
        unchanged = {("vllm-a", "kv"), ("vllm-a", "waiting"), ("sglang-a", "running"),
                     ("sglang-a", "kv"), ("llama-a", "kv"), ("gone", "running")}
        assert not unchanged & set(updated), sorted(unchanged & set(updated))
