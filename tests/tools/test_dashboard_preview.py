"""The dashboard preview's drawing, on the shipped dashboard's JSON (examples/grafana/vconsole.json):
its layout is Grafana's grid, its names and units are Grafana's, every panel is on the page at
its place. Its queries against a real Prometheus: tests/engine/publish/test_prometheus_real.py."""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

import pytest

from vconsole.tools.dashboard_model import (
    COLUMNS,
    GAP_PX,
    HEADER_PX,
    PAGE_PAD_PX,
    ROW_PX,
    QueryResult,
    expand,
    layout,
    legend,
    rate_interval,
    visible_panels,
)
from vconsole.tools.dashboard_preview import (
    NOTICE,
    PanelView,
    Preview,
    Series,
    format_value,
    heatmap_cells,
    main,
    nice_ticks,
    render_html,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "vconsole.json"
WIDTH = 1600


@pytest.fixture(scope="module")
def model() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_layout_is_grafanas_grid_for_every_panel_of_the_dashboard(model: dict) -> None:
    col = (WIDTH - 2 * PAGE_PAD_PX - (COLUMNS - 1) * GAP_PX) / COLUMNS
    boxes = []
    for panel in visible_panels(model):
        g = panel["gridPos"]
        box = layout(g, WIDTH)
        assert box.top == HEADER_PX + g["y"] * (ROW_PX + GAP_PX)
        assert box.height == g["h"] * ROW_PX + (g["h"] - 1) * GAP_PX
        assert box.left == PAGE_PAD_PX + round(g["x"] * (col + GAP_PX))
        assert abs(box.width - (g["w"] * col + (g["w"] - 1) * GAP_PX)) <= 0.5
        boxes.append((panel["title"], box))
    # the page's width is used edge to edge, and no two panels overlap
    assert max(b.left + b.width for _, b in boxes) == pytest.approx(WIDTH - PAGE_PAD_PX, abs=1)
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            apart = (a.left + a.width <= b.left or b.left + b.width <= a.left
                     or a.top + a.height <= b.top or b.top + b.height <= a.top)
            assert apart, (ta, tb)


def test_variables_and_legends_are_filled_in_as_grafana_does() -> None:
    variables = {"model_name": ".*", "__rate_interval": "20s", "engine": "0|1"}
    expr = 'rate(x{model_name=~"$model_name", engine=~"${engine}"}[$__rate_interval])'
    assert expand(expr, variables) == 'rate(x{model_name=~".*", engine=~"0|1"}[20s])'
    labels = {"__name__": "vllm:num_requests_running", "engine": "1", "model_name": "tiny"}
    assert legend("running, engine {{engine}}", labels) == "running, engine 1"
    assert legend("{{ finished_reason }}", {"finished_reason": "stop"}) == "stop"
    assert legend(None, labels) == 'vllm:num_requests_running{engine="1", model_name="tiny"}'
    assert rate_interval(5, 5) == 20 and rate_interval(30, 5) == 35


@pytest.mark.parametrize(("value", "unit", "text"), [
    (0.25, "s", "250 ms"), (2.5e-4, "s", "250 µs"), (1.5, "s", "1.5 s"), (90, "s", "1.5 min"),
    (0.123, "percentunit", "12.3%"), (1500, "short", "1.5 K"), (12, "short", "12"),
    (3.2e10, "flops", "32 GFLOP/s"), (2.5e6, "Bps", "2.5 MB/s"), (640, "tps", "640 tps")])
def test_values_are_formatted_in_the_panels_unit(value: float, unit: str, text: str) -> None:
    assert format_value(value, unit) == text


def test_ticks_are_round_and_cover_the_range() -> None:
    for lo, hi in ((0, 0.73), (0, 1), (0, 812), (-3, 17), (0.2, 0.2)):
        ticks = nice_ticks(lo, hi)
        assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 8
        steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
        assert len(steps) == 1
        mantissa = next(iter(steps)) / 10 ** math.floor(math.log10(next(iter(steps))))
        assert round(mantissa, 6) in (1, 2, 2.5, 5)


def test_heatmap_cells_are_prometheus_buckets_de_accumulated() -> None:
    series = [Series({"le": "+Inf"}, [(10, 9), (15, 9)]), Series({"le": "5.0"}, [(10, 4), (15, 0)]),
              Series({"le": "10.0"}, [(10, 7), (15, 3)])]
    labels, cells = heatmap_cells(series)
    assert labels == ["5.0", "10.0", "+Inf"]
    assert cells == {10: [4, 3, 2], 15: [0, 3, 6]}


def test_every_panel_is_on_the_page_at_its_place_with_its_data_or_its_error(model: dict
                                                                            ) -> None:
    start, step = 1_700_000_000.0, 5.0
    views = []
    for i, panel in enumerate(visible_panels(model)):
        view = PanelView(panel, layout(panel["gridPos"], WIDTH))
        for target in panel.get("targets", ()):
            points = [(start + k * step, float(k % 7 + i)) for k in range(40)]
            view.results.append(QueryResult(target["refId"], target["expr"],
                                            [Series({"le": "+Inf"}, points, "a series")]))
        views.append(view)
    views[1].results[0].error = "bad_data: parse error"
    views[2].results = [QueryResult("A", "absent_thing", [])]
    pre = Preview("vconsole", start, start + 39 * step, step, {"Model": "All"}, views, WIDTH)
    page = render_html(pre)
    assert html.escape(NOTICE) in page and "Model: All" in page
    for view in views:
        b = view.box
        found = re.findall(rf'data-panel-id="{view.id}" data-type="(\w+)" '
                           rf'style="left:(\d+)px;top:(\d+)px;width:(\d+)px;height:(\d+)px"',
                           page)
        assert found == [(view.type, str(b.left), str(b.top), str(b.width), str(b.height))]
    assert "A: bad_data: parse error" in page and page.count("No data") == 1
    drawn = [v for v in views if v.type in ("timeseries", "heatmap")][2:]
    assert page.count("<svg") == len(drawn)
    assert pre.height == max(v.box.top + v.box.height for v in views) + PAGE_PAD_PX


def test_the_command_says_when_prometheus_cannot_be_reached(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    # a port nothing listens on: every query fails, each is named, and the exit code says so
    code = main(["--prometheus", "http://127.0.0.1:9", "--dashboard", str(DASHBOARD),
                 "--since", "5m", "--html", str(tmp_path / "p.html")])
    assert code == 1
    err = capsys.readouterr().err
    assert "E2E Request Latency [A]:" in err
    assert "Connection refused" in (tmp_path / "p.html").read_text()
