"""Regenerate tests/data/synthetic.vrec: 30 s of a toy engine's telemetry, through the real
schema encoder and Recorder (see console/synthetic.py). Run from the repo root:

    .venv/bin/python tests/data/make_recording.py
"""

from pathlib import Path

from console.synthetic import write_recording

if __name__ == "__main__":
    out = Path(__file__).with_name("synthetic.vrec")
    n = write_recording(out, duration_s=30.0, seed=0)
    print(f"wrote {n} records to {out} ({out.stat().st_size:,} bytes)")
