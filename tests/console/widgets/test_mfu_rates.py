"""With --enable-mfu-metrics the Overview's step phases say the engine's estimated FLOP/s and
memory traffic of the last window (the ``step`` topic's ``perf``: the window's own figures over
its length); without it, nothing changes."""

from __future__ import annotations

from typing import Any

from vconsole.console.widgets import panels

LIMITS = {"alert_sched_share_warning": 0.15, "alert_step_time_warning_s": 0.5,
          "alert_step_time_critical_s": 2.0}


class _Eng:
    def __init__(self, step: dict[str, Any]) -> None:
        self.latest = {"step": step}


def _step(**extra: Any) -> dict[str, Any]:
    return {"steps": 10, "window_s": 2.0, "sched_share": 0.01, "step_time_p50_s": 0.05,
            "step_time_max_s": 0.07, "num_prefill_tokens": 0, "num_decode_tokens": 320,
            "phase_s": {"schedule": 0.005, "execute": 0.4, "update": 0.02}, **extra}


def test_the_phases_panel_shows_the_windows_estimated_rates() -> None:
    perf = {"flops_total": 10**13, "read_bytes_total": 10**12, "write_bytes_total": 10**10,
            "flops": 91_000_000_000, "read_bytes": 3_000_000_000, "write_bytes": 200_000_000}
    text = panels.phases(_Eng(_step(perf=perf)), 0.0, 60, LIMITS)     # type: ignore[arg-type]
    line = next(x for x in text.splitlines() if "FLOP/s" in x)
    assert "45.5 GFLOP/s" in line and "1.6 GB/s" in line      # over the 2 s window
    assert "%" not in line                                     # no peak: a GPU engine


def test_a_cpu_engines_rates_are_shares_of_the_measured_peaks() -> None:
    perf = {"flops": 91_000_000_000, "read_bytes": 3_000_000_000, "write_bytes": 200_000_000,
            "peak_flops_per_s": 91e9, "peak_bytes_per_s": 16e9}
    text = panels.phases(_Eng(_step(perf=perf)), 0.0, 60, LIMITS)     # type: ignore[arg-type]
    line = next(x for x in text.splitlines() if "FLOP/s" in x)
    assert "45.5 GFLOP/s" in line and "50%" in line and "10%" in line


def test_without_the_metrics_the_panel_is_unchanged() -> None:
    text = panels.phases(_Eng(_step()), 0.0, 60, LIMITS)              # type: ignore[arg-type]
    assert "FLOP/s" not in text
