"""Regenerate tests/data/engine.vrec: telemetry recorded from a real `vconsole engine` process
(tiny model, small KV pool stored as int8 blocks) serving the demo's varying load. Run from the repo root:

    .venv/bin/python tests/data/record_engine.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from vconsole.telemetry.record import record_stream  # noqa: E402
from vconsole.tools.demo import DemoStack  # noqa: E402

if __name__ == "__main__":
    out = Path(__file__).with_name("engine.vrec")
    args = ["--model", "tiny", "--kv-cache-dtype", "int8", "--num-kv-blocks", "96",
            "--max-num-seqs", "16",
            "--policy", "hybrid", "--set", "engine_id=recorded-0"]
    with DemoStack(args, rate=40.0) as stack:
        time.sleep(4.0)  # let the load build up before recording
        counts = record_stream(stack.endpoints["telemetry"], out, duration_s=8.0)
    print(f"wrote {sum(counts.values())} records {counts} to {out} "
          f"({out.stat().st_size:,} bytes)")
