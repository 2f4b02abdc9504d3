"""Regenerate tests/data/synthetic.vrec: 30 s of a toy engine's telemetry, through the real
schema encoder and Recorder (see tests/support/synthetic.py). Run from the repo root:

    .venv/bin/python tests/data/make_recording.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.synthetic import write_recording  # noqa: E402

if __name__ == "__main__":
    out = Path(__file__).with_name("synthetic.vrec")
    # Without the ``latency`` topic and the KV format fields: the recording stands for a stream
    # from an engine that predates them, which the console must still show (its latency plots
    # say "no latency data"; the KV panel names no dtype).
    n = write_recording(out, duration_s=30.0, seed=0, latency=False, kv_format=None)
    print(f"wrote {n} records to {out} ({out.stat().st_size:,} bytes)")
