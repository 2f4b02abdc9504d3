"""`vconsole whatif --validate`: each prediction checked against the real engine.

For the baseline and each variant: an engine process is started with the trace's model and
config under the variant's changes (the pool sized as the prediction sized it, in blocks), the
trace is replayed against it on its own timestamps (`vconsole.tools.trace_replay`, as `vconsole
load --trace` does), and the engine's own request trace of that run gives the real figures
(`figures`, the same function the prediction's figures come from). Each entry of the report
gains ``validated`` (the real figures) and ``validation_error`` (prediction over real - 1).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.telemetry.request_trace import Trace, read_trace
from vconsole.tools.loadgen import run_timed
from vconsole.tools.trace_replay import plan_replay
from vconsole.whatif.predict import errors, observed

# Restart-only keys carried from the trace's config to the validation engine (the model and
# the memory it owns); the pool is given in blocks, as the prediction sized it.
CARRIED = ("device", "dtype", "quantization", "max_model_len", "seed", "hybrid_aging_s",
           "max_holding_seconds", "enable_prefix_caching")
ENGINE_START_S = 300.0


def engine_args(trace: Trace, config_view: dict[str, Any], trace_path: Path) -> list[str]:
    """`vconsole engine` arguments for the trace's engine under ``config_view`` (a report's
    ``config``: the scheduler keys, block size, KV dtype and pool blocks it was predicted
    with), writing its own request trace to ``trace_path``."""
    h = trace.header
    if not h.model:
        raise ValueError("the trace names no model (a CSV trace): nothing to validate on")
    args = ["--model", h.model]
    values = {k: h.config[k] for k in CARRIED if k in h.config}
    values.update(config_view)
    values["request_trace"] = str(trace_path)
    for key, value in values.items():
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--set", f"{key}={text}"]
    return args


def run_real(trace: Trace, config_view: dict[str, Any], *,
             log: Callable[[str], None] | None = None, keep: Path | None = None) -> Trace:
    """The engine's own trace of replaying ``trace`` under ``config_view``; ``keep``: a copy of
    that trace written there too (to judge another prediction against it later)."""
    with tempfile.TemporaryDirectory(prefix="vconsole-whatif-") as tmp:
        path = Path(tmp) / "real.jsonl"
        engine = EngineProcess(engine_args(trace, config_view, path))
        engine.start(timeout_s=ENGINE_START_S)
        try:
            endpoints = engine.endpoints

            async def replay() -> None:
                async with AsyncEngineClient(endpoints["input"], endpoints["output"],
                                             timeout_s=60.0) as client:
                    plan = plan_replay(trace, client.engine_info)
                    run = await run_timed(client, plan.requests)
                    failed = run.summary()["failed"]
                    if failed:
                        raise RuntimeError(f"{failed} of {run.sent} replayed requests failed "
                                           f"on the validation engine")

            asyncio.run(replay())
        finally:
            code = engine.stop()
        if code not in (0, None):
            raise RuntimeError(f"the validation engine exited with code {code}: "
                               f"{engine.log_tail(5)}")
        if keep is not None:
            shutil.copyfile(path, keep)
        return read_trace(path)


def validate(trace: Trace, report: dict[str, Any], *,
             progress: Callable[[str], None] | None = None) -> None:
    """Fill ``validated`` / ``validation_error`` into ``report`` (see the module docstring).
    A trace whose config changed while it ran is refused: the prediction replays those
    changes at their times, a validation engine would run one config."""
    if len(trace.configs) > 1:
        raise ValueError(f"the trace's config changed while it ran (config versions "
                         f"{', '.join(map(str, sorted(trace.configs)))}): a validation runs "
                         f"one config; validate on a trace recorded under one")
    entries = [("baseline", report["baseline"])] + [
        (", ".join(f"{k}={v}" for k, v in e["set"].items()), e) for e in report["variants"]]
    for i, (label, entry) in enumerate(entries, 1):
        if progress:
            progress(f"validating {i}/{len(entries)} ({label}): replaying "
                     f"{trace.duration_s:.0f} s of trace on a real engine")
        real = run_real(trace, entry["config"])
        obs = observed(real)
        entry["validated"] = obs
        entry["validation_error"] = errors(entry["predicted"], obs)
