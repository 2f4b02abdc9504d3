"""One run of every check that needs an NVIDIA GPU, written as one JSON report.

    python scripts/gpu_check.py [--out gpu_check.json] [--budget-s 540]

Run by `scripts/gpu_check.sh` (which installs the project first). Each check runs in order,
under what is left of the time budget, and records ``{"ok": bool, ...figures}`` or
``{"skipped": why}`` / ``{"error": what}``; the report is rewritten after every check, so a run
cut short still leaves what it measured. Without CUDA (this is what a CPU machine prints) the
CUDA checks say "skipped: no CUDA device" and the others (doctor, NVML) still run.

Checks: the environment; ``vconsole doctor --json``; NVML through the telemetry probe; greedy
parity with transformers' ``generate`` on small-gqa in float32 (token for token) and bfloat16
(first divergence reported: bf16 kernels may round differently); engine throughput on CUDA
against transformers' static batched ``generate`` (same workload as ``bench throughput``);
``vconsole profile`` over a live CUDA engine (the profiler's CUDA path); two data-parallel
ranks sharing the one GPU serving requests; ``vconsole bench serve`` on CUDA; NVTX ranges
(``--set nvtx=true``) and ``vconsole profile --nsys`` on a CUDA engine under load, inside
``nsys profile --capture-range=cudaProfilerApi`` when nsys is installed (then ``nsys stats``
must list the engine's ranges), else without it (the report says which), and ``vconsole
stacks`` of that engine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PY = sys.executable
DEVICE = "cuda"      # --device cpu runs the same checks on the CPU (to try the script itself)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _vconsole(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "vconsole", *args], capture_output=True, text=True,
                          timeout=timeout)


# --- the checks ------------------------------------------------------------------------------

def check_env(_left: float) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"ok": True, "python": sys.version.split()[0],
                           "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if out["cuda"]:
        out.update(device=torch.cuda.get_device_name(0), devices=torch.cuda.device_count(),
                   cuda_version=torch.version.cuda,
                   free_bytes=torch.cuda.mem_get_info()[0])
    return out


def check_doctor(left: float) -> dict[str, Any]:
    r = _vconsole("doctor", "--json", timeout=min(left, 120))
    try:
        body = json.loads(r.stdout)
    except ValueError:
        return {"ok": False, "exit": r.returncode, "stderr": r.stderr[-2000:]}
    return {"ok": r.returncode == 0, "exit": r.returncode, "report": body}


def check_nvml(_left: float) -> dict[str, Any]:
    from vconsole.telemetry.gpu import GpuProbe

    reading = GpuProbe().read()
    return {"ok": bool(reading.get("available")) == _cuda(), "reading": reading}


def _parity(dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from vconsole.engine.core import EngineCore
    from vconsole.engine.offline import greedy_requests, run_batch
    from vconsole.engine.worker.tiny_model import ensure_model
    from vconsole.shared.config import EngineConfig

    model_dir = str(ensure_model("small-gqa"))
    prompts = [[3 + (7 * i + k) % 240 for k in range(8 + 5 * i)] for i in range(8)]
    n = 32
    core = EngineCore(EngineConfig(model=model_dir, device=DEVICE, dtype=dtype,
                                   num_kv_blocks=512, max_num_seqs=8))
    # As the suite's parity tests: greedy, stopping at EOS on both sides (transformers'
    # min_new_tokens would mask EOS, which ignore_eos does not).
    ours = run_batch(core, greedy_requests(core, prompts, n)).output_token_ids
    forward = core.runner.forward_path  # "fused" unless VCONSOLE_FORWARD=transformers
    del core
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                              dtype=torch_dtype).to(DEVICE).eval()
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=n)
            theirs.append(out[0, len(p):].tolist())
    first_diff = [next((j for j, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                       None if len(x) == len(y) else min(len(x), len(y)))
                  for x, y in zip(ours, theirs, strict=True)]
    equal = sum(1 for d in first_diff if d is None)
    return {"ok": equal == len(prompts) if dtype == "float32" else True,
            "equal_sequences": equal, "of": len(prompts), "first_divergence": first_diff,
            "forward": forward}


def check_parity_fp32(_left: float) -> dict[str, Any]:
    return _parity("float32")


def check_parity_bf16(_left: float) -> dict[str, Any]:
    return _parity("bfloat16")


def check_throughput(_left: float) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from vconsole.engine.core import EngineCore
    from vconsole.engine.offline import greedy_requests, run_batch
    from vconsole.engine.worker.tiny_model import ensure_model
    from vconsole.shared.config import EngineConfig
    from vconsole.tools.bench.throughput_peers import run_static_generate
    from vconsole.tools.bench.throughput_workload import make_workload

    model_dir = str(ensure_model("small-gqa"))
    wl = make_workload(64)
    core = EngineCore(EngineConfig(model=model_dir, device=DEVICE, dtype="bfloat16",
                                   max_num_seqs=64, max_num_batched_tokens=2048))
    run_batch(core, greedy_requests(core, make_workload(2, seed=99).prompts, 4,
                                    ignore_eos=True, prefix="warm"))
    res = run_batch(core, greedy_requests(core, wl.prompts, wl.output_lens, ignore_eos=True))
    ours = res.num_output_tokens / res.elapsed_s
    del core
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                              dtype=torch.bfloat16).to(DEVICE).eval()
    static = run_static_generate(hf, wl, device=DEVICE)
    return {"ok": True, "engine_tokens_per_s": round(ours, 1),
            "static_generate_tokens_per_s": static["tokens_per_s"], "device": DEVICE,
            "ratio": round(ours / static["tokens_per_s"], 3), "steps": res.num_steps}


def _engine(args: list[str], port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PY, "-m", "vconsole", "engine", "--device", DEVICE,
                             "--base-port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_up(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = _vconsole("get", "--base-port", str(port), timeout=30)
        if r.returncode == 0:
            return True
        time.sleep(2)
    return False


def check_profile(left: float) -> dict[str, Any]:
    port = 28100
    eng = _engine(["--model", "small-gqa"], port)
    try:
        if not _wait_up(port, min(left, 180)):
            return {"ok": False, "error": "the CUDA engine did not come up"}
        load = subprocess.Popen([PY, "-m", "vconsole", "load", "--base-port", str(port),
                                 "--num", "200", "--concurrency", "16"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = _vconsole("profile", "--base-port", str(port), "--steps", "20", "--json",
                      timeout=min(left, 180))
        load.wait(120)
        body = json.loads(r.stdout) if r.returncode == 0 else {"stderr": r.stderr[-2000:]}
        return {"ok": r.returncode == 0, "profile": body}
    finally:
        eng.terminate()
        eng.wait(60)


def check_dp_one_gpu(left: float) -> dict[str, Any]:
    port = 28200
    eng = _engine(["--model", "tiny", "--data-parallel-size", "2"], port)
    try:
        if not _wait_up(port, min(left, 240)):
            return {"ok": False, "error": "the 2-rank group did not come up"}
        r = _vconsole("load", "--base-port", str(port), "--num", "64", "--concurrency", "16",
                      "--json", timeout=min(left, 240))
        body = json.loads(r.stdout) if r.returncode == 0 else {"stderr": r.stderr[-2000:]}
        top = _vconsole("top", "--once", "--json", "--base-port", str(port), timeout=60)
        ranks = sorted(json.loads(top.stdout).get("ranks", {})) if top.returncode == 0 else []
        return {"ok": r.returncode == 0 and body.get("completed") == 64 and ranks == ["0", "1"],
                "load": body, "ranks": ranks}
    finally:
        eng.terminate()
        eng.wait(90)


def check_bench_serve(left: float) -> dict[str, Any]:
    r = _vconsole("bench", "serve", "--json", "--no-transformers", timeout=min(left, 420))
    if r.returncode != 0:
        return {"ok": False, "stderr": r.stderr[-2000:]}
    return {"ok": True, "report": json.loads(r.stdout)}


def _nsys() -> str | None:
    found = shutil.which("nsys") or sorted(glob.glob("/opt/nvidia/nsight-systems/*/bin/nsys")
                                           + glob.glob("/usr/local/cuda*/bin/nsys"))
    return (found[-1] if isinstance(found, list) and found else found) or None


def check_nvtx_nsys(left: float) -> dict[str, Any]:
    """A CUDA engine with ``nvtx=true`` under load; ``vconsole profile --nsys`` opens and
    closes the capture range around 10 steps; under nsys (when present) its report must hold
    the ranges. Also ``vconsole stacks`` of the same engine (py-spy, else the signal dump)."""
    port, nsys = 28300, _nsys()
    out_dir = Path(os.environ.get("OUT") or ".")
    report_base = out_dir / "vconsole_nvtx"
    engine_cmd = [PY, "-m", "vconsole", "engine", "--device", DEVICE, "--base-port", str(port),
                  "--model", "small-gqa", "--set", "nvtx=true", "--no-supervisor"]
    if nsys:
        engine_cmd = [nsys, "profile", "-t", "cuda,nvtx", "--capture-range=cudaProfilerApi",
                      "--capture-range-end=stop", "-o", str(report_base), "--force-overwrite",
                      "true", *engine_cmd]
    eng = subprocess.Popen(engine_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    result: dict[str, Any] = {"nsys": nsys or "not installed: ranges and the capture range "
                              "run without a recorder"}
    try:
        if not _wait_up(port, min(left, 180)):
            return {**result, "ok": False, "error": "the CUDA engine did not come up"}
        load = subprocess.Popen([PY, "-m", "vconsole", "load", "--base-port", str(port),
                                 "--num", "200", "--concurrency", "16"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = _vconsole("profile", "--nsys", "--base-port", str(port), "--steps", "10", "--json",
                      timeout=min(left, 120))
        st = _vconsole("stacks", "--base-port", str(port), "--json", timeout=60)
        load.terminate()            # it only had to keep the engine stepping
        load.wait(30)
        if DEVICE == "cpu":      # trying the script: the refusal is the expected outcome
            result.update(ok=r.returncode == 1 and "needs CUDA" in r.stderr,
                          refused=r.stderr.strip()[-300:])
        else:
            body = json.loads(r.stdout) if r.returncode == 0 else {"stderr": r.stderr[-2000:]}
            result.update(ok=r.returncode == 0 and body.get("nvtx_ranges") is True,
                          capture=body)
        if st.returncode == 0:
            stacks = json.loads(st.stdout)
            busy = stacks["threads"][0]
            result["stacks"] = {"method": stacks["method"], "threads": len(stacks["threads"]),
                                "busy_loop": busy["busy_loop"],
                                "top": [f["function"] for f in busy["frames"][:4]]}
        else:
            result.update(ok=False, stacks_error=st.stderr[-1000:])
    finally:
        eng.terminate()
        try:
            eng.wait(120)           # nsys writes its report once the engine exits
        except subprocess.TimeoutExpired:
            eng.kill()
    if nsys and DEVICE == "cuda":
        rep = report_base.with_suffix(".nsys-rep")
        stats = subprocess.run([nsys, "stats", "--report", "nvtx_sum", "--format", "csv",
                                str(rep)], capture_output=True, text=True, timeout=180)
        ranges = {n for n in ("step", "schedule", "execute", "update", "layer 0")
                  if f'"{n}"' in stats.stdout or f",{n}\n" in stats.stdout
                  or f",{n}," in stats.stdout}
        result.update(report=str(rep), report_exists=rep.exists(),
                      ranges_in_report=sorted(ranges), nsys_stats_tail=stats.stdout[-1500:]
                      or stats.stderr[-1500:])
        result["ok"] = bool(result.get("ok")) and {"execute", "layer 0"} <= ranges
    return result


CHECKS: list[tuple[str, Callable[[float], dict[str, Any]], bool]] = [
    # (name, check, needs CUDA)
    ("env", check_env, False),
    ("doctor", check_doctor, False),
    ("nvml", check_nvml, False),
    ("parity_small_gqa_float32", check_parity_fp32, True),
    ("parity_small_gqa_bfloat16", check_parity_bf16, True),
    ("throughput_small_gqa_bf16", check_throughput, True),
    ("profile_cuda", check_profile, True),
    ("dp_two_ranks_one_gpu", check_dp_one_gpu, True),
    ("nvtx_nsys", check_nvtx_nsys, True),
    ("bench_serve", check_bench_serve, True),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: run the CUDA checks on the CPU, to try this script")
    ap.add_argument("--only", action="append", default=[], metavar="CHECK",
                    help="run only these checks (repeatable)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    deadline = time.monotonic() + args.budget_s
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "checks": {}}
    cuda = _cuda() or DEVICE == "cpu"
    for name, check, needs_cuda in CHECKS:
        if args.only and name not in args.only:
            continue
        left = deadline - time.monotonic()
        t0 = time.monotonic()
        if needs_cuda and not cuda:
            result: dict[str, Any] = {"skipped": "no CUDA device"}
        elif left < 20:
            result = {"skipped": "out of time"}
        else:
            try:
                result = check(left)
            except Exception as e:   # one check failing must not lose the others
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = round(time.monotonic() - t0, 1)
        report["checks"][name] = result
        print(f"{name}: {json.dumps(result, default=str)[:300]}", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    ran = [r for r in report["checks"].values() if "skipped" not in r]
    report["ok"] = all(r.get("ok") for r in ran)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({"ok": report["ok"], "out": args.out}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
