"""The monitoring examples that ship: examples/prometheus/alerts.yml (checked and unit-tested by
the real promtool) and examples/grafana/vconsole.json (Grafana's dashboard JSON model, every
query parsed by promtool). That the dashboard's queries return series from a live `vconsole
serve` is tests/engine/publish/test_prometheus_real.py's."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.prometheus import DASHBOARD, dashboard_panels, dashboard_queries, require
from vconsole.shared.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "examples" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "examples" / "prometheus" / "alerts.test.yml"

# alert -> the config default that is its threshold (the engine's alert table)
ALERT_THRESHOLDS = {
    "VconsoleStepTimeWarning": "alert_step_time_warning_s",
    "VconsoleStepTimeCritical": "alert_step_time_critical_s",
    "VconsoleWaitingQueueWarning": "alert_waiting_warning",
    "VconsoleWaitingQueueCritical": "alert_waiting_critical",
    "VconsoleGpuMemoryWarning": "alert_gpu_memory_warning",
    "VconsoleGpuMemoryCritical": "alert_gpu_memory_critical",
    "VconsoleSchedulerShareWarning": "alert_sched_share_warning",
    "VconsoleKVFragmentationWarning": "fragmentation_threshold",
}


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = require("promtool")["promtool"]
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def _alerts() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_the_alert_rules_pass_promtool_check_rules() -> None:
    done = _promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_each_alert_fires_above_its_threshold_not_below_and_holds_in_its_release_band() -> None:
    done = _promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert tested == set(_alerts())            # every alert has its unit test


def test_thresholds_and_release_points_are_the_engines_own() -> None:
    """Each rule fires at the config default the engine's alert uses, and its hysteresis branch
    releases at that threshold less ``alert_hysteresis`` (10 %), as the engine's evaluator."""
    config = EngineConfig()
    margin = 1 - config.alert_hysteresis
    alerts = _alerts()
    for name, key in ALERT_THRESHOLDS.items():
        threshold = float(getattr(config, key))
        raise_at, release_at = (float(x) for x in re.findall(r">= ([\d.]+)", alerts[name]["expr"]))
        assert raise_at == pytest.approx(threshold), name
        assert release_at == pytest.approx(threshold * margin), name
        assert f'ALERTS{{alertname="{name}", alertstate="firing"}}' in alerts[name]["expr"]
        assert alerts[name]["labels"]["severity"] in name.lower()
        assert alerts[name]["for"] == "1m"


def test_the_dashboard_is_a_grafana_json_model_with_a_datasource_variable() -> None:
    model = json.loads(DASHBOARD.read_text())
    assert isinstance(model["schemaVersion"], int) and model["schemaVersion"] >= 36
    assert model["uid"] and model["title"] == "vconsole"
    panels = dashboard_panels(model)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in panels
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells))       # no two panels overlap


def test_the_dashboard_has_vllms_panels_and_ours() -> None:
    titles = {p["title"] for p in dashboard_panels(json.loads(DASHBOARD.read_text()))}
    vllm = {"E2E Request Latency", "Token Throughput", "Inter-Token Latency", "Scheduler State",
            "Time To First Token Latency", "Cache Utilization", "Finish Reason", "Queue Time",
            "Requests Prefill and Decode Time"}
    ours = {"KV Fragmentation", "Step Phases", "Preemptions", "Tokens/s Per Rank"}
    opt_in = {"KV Block Lifetime", "KV Block Idle Before Eviction", "KV Block Reuse Gap",
              "Estimated FLOP/s Per Rank", "Estimated Memory Bandwidth Per Rank"}
    assert vllm | ours | opt_in <= titles


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule's expression)."""
    model = json.loads(DASHBOARD.read_text())
    rules = [{"record": f"dashboard:query_{i}", "expr": expr}
             for i, (_, expr) in enumerate(dashboard_queries(model))]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = _promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
