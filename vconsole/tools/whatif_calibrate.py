"""`vconsole whatif TRACE --calibrate`: the step costs of the shapes the variants need, measured.

An engine process is started with the trace's model and config, given the most seats, the
largest token budget and the largest pool any variant asks for
(`vconsole.whatif.calibration.engine_config`), and writing its own request trace to
``TRACE.calib.jsonl`` (`calibration_path`). The probes of `vconsole.whatif.calibration.grid`
run one after the other, each probe's requests sent together and awaited, `REPEATS` times;
then the engine stops and its trace is the calibration, read back to check it holds steps.

The probe engine is a process of its own, started for this and stopped after: on a machine
where a live engine serves, it shares that machine's cores while it runs (a few seconds on
the tiny model, a minute or two on a real one), so run it when the engine is idle or on a
machine like the engine's.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.telemetry.request_trace import Trace, read_trace
from vconsole.tools.loadgen import TimedRequest, run_timed
from vconsole.tools.whatif_validate import ENGINE_START_S, engine_args
from vconsole.whatif.calibration import REPEATS, Probe, calibration_path, engine_config, grid
from vconsole.whatif.predict import Baseline, config_view


def plan(trace: Trace, variants: list[dict[str, Any]]) -> tuple[dict[str, Any], list[Probe]]:
    """The probe engine's config view and the probes, for ``trace`` and its ``variants``."""
    base = Baseline(trace)
    view = config_view(base, {})
    sized = [config_view(base, v) for v in variants]
    cfg = engine_config(view, base.num_kv_blocks, sized)
    probes = grid(view, cfg["num_kv_blocks"], base.block_size, base.max_model_len, sized)
    return cfg, probes


def calibrate(trace: Trace, trace_path: str | Path, variants: list[dict[str, Any]], *,
              progress: Callable[[str], None] | None = None) -> tuple[Path, Trace]:
    """Run the grid (see the module docstring); the calibration's path and its trace."""
    cfg, probes = plan(trace, variants)
    out = calibration_path(trace_path)
    out.unlink(missing_ok=True)
    if progress:
        progress(f"calibrating: {len(probes)} probes x {REPEATS} on an engine of "
                 f"{trace.header.model} ({cfg['max_num_seqs']} seats, "
                 f"{cfg['max_num_batched_tokens']}-token steps, {cfg['num_kv_blocks']} "
                 f"blocks), kept in {out}")
    engine = EngineProcess(engine_args(trace, cfg, out))
    engine.start(timeout_s=ENGINE_START_S)
    try:
        endpoints = engine.endpoints

        async def run() -> None:
            async with AsyncEngineClient(endpoints["input"], endpoints["output"],
                                         timeout_s=60.0) as client:
                vocab = int(client.engine_info.get("vocab_size") or 1000)
                rng = random.Random(0)
                for _ in range(REPEATS):
                    for p in probes:
                        batch = [TimedRequest(0.0, [rng.randrange(2, vocab)
                                                    for _ in range(p.prompt_len)],
                                              p.output_len) for _ in range(p.rows)]
                        done = await run_timed(client, batch)
                        failed = done.summary()["failed"]
                        if failed:
                            raise RuntimeError(f"{failed} of {p.rows} probe requests failed "
                                               f"({p.rows} rows of {p.prompt_len} tokens)")

        asyncio.run(run())
    finally:
        code = engine.stop()
    if code not in (0, None):
        raise RuntimeError(f"the calibration engine exited with code {code}: "
                           f"{engine.log_tail(5)}")
    return out, read_trace(out)
