"""RayCluster: the Ray this engine runs its ranks on — joined, or started and owned.

``--ray-address auto|HOST:PORT`` joins a running cluster (``ray start --head`` on one box,
``ray start --address HEAD:PORT`` on the others); without it the engine starts a local Ray of its
own (`start_head`: ``ray start --head --block`` on loopback, in a session of its own): this
machine's CPUs (at least one per rank), no dashboard, no usage report, shut down with the
engine. Its files live in a short private temporary folder (0700; Ray's own in a subfolder of
it, as Ray makes its temporary folder world-writable). Loopback: Ray turns ``127.0.0.1`` given as
a node address into this machine's network address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
is ``0`` (Ray's single-machine mode, `LOOPBACK_ENV`); with it, set for the head (and so every
worker) and for this driver (`use_loopback`), the node address is ``127.0.0.1`` and the GCS and
raylet listen on 127.0.0.1 only. Ray's token authentication is forced on for it as well (other
users of this machine), with a token of its own in that folder (mode 0600). Ray's
own logging stays at WARNING; the ranks' output reaches this process's stderr (Ray prefixes
each line with the actor).

Each engine works in a namespace of its own (``vconsole-<engine id>-<random>``), so two engines
in one cluster never see each other's actors or placement groups.

Invariant: after `close` an owned Ray has no process left (its session folder is the marker:
every process it started has it on its command line, `processes_of`), and a joined cluster keeps
nothing of this engine's: the launcher removes its actors and placement groups first, and this
driver's disconnect makes Ray drop whatever is left (the actors are not detached).

``ray`` is imported here and in the other modules of this package only, and only when a Ray
backend is used: `require_ray` turns its absence into `RayMissing` with the install hint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from vconsole.engine.launch.child import ChildProcess

log = logging.getLogger("vconsole.engine.dp")

LOOPBACK = "127.0.0.1"
HEAD_READY = "will now block"     # `ray start --block`'s line once the head runs

INSTALL_HINT = "pip install 'vconsole[ray]'"
# Variables a rank needs from the launcher's environment (a cluster's raylet started elsewhere
# has its own): offline model loading, the model/kernel caches, vconsole's own settings that a
# rank's engine reads. An allow-list, because Ray writes a runtime environment into its
# ``runtime_env_agent.log`` (readable by all) and copies it to every node: no token or key
# (``HF_TOKEN``, ``VCONSOLE_API_KEY``) ever goes there.
RANK_ENV = frozenset({
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT",
    "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE", "TOKENIZERS_PARALLELISM",
    "TORCHINDUCTOR_CACHE_DIR",
    "VCONSOLE_CACHE", "VCONSOLE_KERNEL_CACHE", "VCONSOLE_ATTENTION_KERNEL", "VCONSOLE_CPU_LINEAR",
    "VCONSOLE_FORWARD", "VCONSOLE_STACKS_METHOD", "VCONSOLE_RUNTIME_DIR",
    "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",     # `vconsole.engine.omp_wait`
})
SECRET_LIKE = re.compile(r"(^|_)(TOKEN|KEY|PASSWORD|PASSWD|CREDENTIALS?|AUTH)(_|$)|SECRET",
                         re.IGNORECASE)            # never forwarded, even if listed above
TOKEN_FILE = "auth_token"          # an owned Ray's token, in its private folder
RAY_DIR = "r"       # an owned Ray's --temp-dir, inside our 0700 folder: Ray makes it 0777
# "0": Ray's single-machine mode, in which 127.0.0.1 stays the node address (Ray 2.60 otherwise
# replaces a loopback --node-ip-address, and the address a driver joins, by this machine's
# network address; `ray._private.services.get_node_ip_address`).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayMissing(RuntimeError):
    """``--data-parallel-backend ray`` without the ``ray`` package."""


def require_ray() -> ModuleType:
    """``ray``, imported with our log settings: every rank's lines kept (no "repeated 2x across
    cluster" folding of two ranks' equal lines) and no colour codes in a log file."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        import ray
    except ImportError:
        raise RayMissing("--data-parallel-backend ray needs Ray: "
                         f"{INSTALL_HINT}") from None
    return ray


def rank_env_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What each rank actor's runtime environment carries over from this process."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k in RANK_ENV and not SECRET_LIKE.search(k)}


def head_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Ray we start: this process's, less anything secret-like (every
    rank's worker process inherits it from the raylet)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not SECRET_LIKE.search(k)}


def processes_of(temp_dir: str | os.PathLike[str]) -> list[int]:
    """PIDs of the processes an owned Ray started (their command lines name its session
    folder): empty once it is shut down."""
    import psutil

    marker = str(temp_dir)
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if any(marker in part for part in p.info["cmdline"] or ()):
                out.append(p.info["pid"])
    return out


def use_token_if_any() -> None:
    """Ray's token authentication (on by default for clusters started by Ray >= 2.5x, the token
    in ``~/.ray/auth_token`` or ``$RAY_AUTH_TOKEN``/``$RAY_AUTH_TOKEN_PATH``): a driver that
    joins sends it only in token mode, which Ray does not infer for a joining driver. Unless
    ``RAY_AUTH_MODE`` says otherwise, a token present here turns it on."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file()):
        os.environ["RAY_AUTH_MODE"] = "token"
        with contextlib.suppress(Exception):     # Ray reads its config once, at import
            from ray._raylet import Config  # type: ignore[attr-defined]

            Config.initialize("")


def use_loopback(on: bool = True) -> None:
    """This process (a driver) reaches a loopback-only Ray at ``127.0.0.1`` as such (``on``), or
    again takes this machine's network address for loopback, Ray's default (``on=False``). Ray
    reads `LOOPBACK_ENV` once, at import: the setting is applied to its constant too."""
    if on:
        os.environ[LOOPBACK_ENV] = "0"
    else:
        os.environ.pop(LOOPBACK_ENV, None)
    constants: Any = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = (not on) and not constants.IS_WINDOWS_OR_OSX


def write_token(temp_dir: Path) -> Path:
    """A fresh Ray auth token for a Ray we start, in ``temp_dir`` (private: 0700) with mode
    0600: not ``~/.ray/auth_token``, which every Ray of this user would share."""
    path = temp_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16))
    return path


def token_env(token_path: Path) -> dict[str, str]:
    """The environment that turns Ray's token authentication on with the token in
    ``token_path`` (whatever ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` the operator has set)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def use_token_file(token_path: Path) -> None:
    """This process (a driver) authenticates with the token in ``token_path``."""
    os.environ.pop("RAY_AUTH_TOKEN", None)        # Ray reads it before the path
    os.environ.update(token_env(token_path))
    with contextlib.suppress(Exception):     # Ray reads its config once, at import
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


class LocalHead:
    """``ray start --head --block`` as a child in a session of its own: a signal to the
    engine's process group (a terminal's Ctrl-C, a ``killpg``) never reaches Ray's processes,
    so the launcher can still drain and remove its actors; `stop` ends the session (SIGTERM
    to its group: ``ray start --block`` stops what it started; SIGKILL after a grace period),
    and the engine's death does too (the child's parent-death signal)."""

    def __init__(self, child: ChildProcess, port: int, log_path: Path) -> None:
        self.child = child
        self.port = port
        self.log_path = log_path

    def stop(self, grace_s: float = 3.0) -> None:
        """Short: by now nothing of ours runs on this Ray (`ray start --block` takes 10 s or
        more on a loaded machine to stop its processes one by one; SIGKILL to the session's
        group is as good for a cluster whose session folder is about to go)."""
        self.child.stop(grace_s)


def start_head(temp_dir: Path, num_cpus: int, token_path: Path,
               timeout_s: float = 120.0, *, loopback: bool = True) -> LocalHead:
    """A local Ray head with ``num_cpus`` CPUs and no dashboard; raises ``ConnectionError``
    with the tail of its log if it does not start. ``temp_dir`` is our private (0700) folder:
    Ray's own session files go to ``temp_dir/r`` (Ray makes its temp dir 0777; the private
    parent keeps other users out of its logs and sockets), the token beside it.

    ``loopback``: its node address is 127.0.0.1 and its GCS and raylet listen there only
    (`LOOPBACK_ENV`; a driver joins it after `use_loopback`); else Ray's default, this
    machine's network address, every interface. Either way Ray's token authentication is
    forced on (``RAY_AUTH_MODE=token`` even when the operator's environment says
    ``disabled``) with the token in ``token_path``."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = int(s.getsockname()[1])
    exe = Path(sys.executable).with_name("ray")
    command = [str(exe) if exe.exists() else (shutil.which("ray") or "ray"), "start", "--head",
               "--block", *(["--node-ip-address", LOOPBACK] if loopback else []),
               "--port", str(port), "--num-cpus", str(num_cpus), "--include-dashboard", "false",
               "--disable-usage-stats", "--temp-dir", str(temp_dir / RAY_DIR)]
    env = {**head_env(), "RAY_USAGE_STATS_ENABLED": "0", **token_env(token_path)}
    env.pop(LOOPBACK_ENV, None)
    if loopback:
        env[LOOPBACK_ENV] = "0"
    log_path = temp_dir / "ray-start.log"
    with open(log_path, "wb") as out:
        child = ChildProcess(command, stdout=out, stderr=subprocess.STDOUT, own_group=True,
                             env=env)
    deadline = time.monotonic() + timeout_s
    while HEAD_READY not in log_path.read_text(errors="replace"):
        if child.poll() is not None or time.monotonic() > deadline:
            child.stop(5.0)
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise ConnectionError(f"a local Ray did not start (`{' '.join(command)}`):\n{tail}")
        time.sleep(0.2)
    return LocalHead(child, port, log_path)


class RayCluster:
    """`connect` joins or starts Ray in this process (the driver); `close` undoes it."""

    def __init__(self, ray: ModuleType, namespace: str, temp_dir: Path | None = None,
                 head: LocalHead | None = None) -> None:
        self.ray = ray
        self.head = head
        self.namespace = namespace
        self.temp_dir = temp_dir          # set: this Ray is ours (started here)
        self.node_id: str = ray.get_runtime_context().get_node_id()

    @property
    def owned(self) -> bool:
        return self.temp_dir is not None

    @classmethod
    def connect(cls, address: str | None, *, engine_id: str, min_cpus: int = 1) -> RayCluster:
        """Join the cluster at ``address`` (``auto`` or ``HOST:PORT``), or start a local Ray with
        max(cores, ``min_cpus``) CPUs. Raises `RayMissing`, or `ConnectionError` with Ray's
        reason when the cluster cannot be reached."""
        ray = require_ray()
        namespace = f"vconsole-{engine_id}-{uuid.uuid4().hex[:8]}"
        common: dict[str, Any] = dict(namespace=namespace, log_to_driver=True,
                                      logging_level=logging.WARNING,
                                      runtime_env={"env_vars": rank_env_vars()})
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if address:
            use_token_if_any()
            try:
                ray.init(address=address, **common)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConnectionError(f"cannot join the Ray cluster at {address}: "
                                      f"{str(e).splitlines()[0] if str(e) else e!r}") from None
            except BaseException:       # e.g. SIGTERM inside ray.init (its handler exits)
                with contextlib.suppress(Exception):
                    ray.shutdown()
                raise
            return cls(ray, namespace, None)
        # Short: Ray's unix sockets live under it (a socket path has ~107 characters).
        temp_dir = Path(tempfile.mkdtemp(prefix="vcray-", dir="/tmp"))
        try:
            token_path = write_token(temp_dir)
            head = start_head(temp_dir, max(os.cpu_count() or 1, min_cpus), token_path)
            try:
                use_token_file(token_path)
                use_loopback()
                ray.init(address=f"{LOOPBACK}:{head.port}", **common)
            except BaseException:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                head.stop()
                raise
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        log.info("started a local Ray (%s, session folder %s)", namespace, temp_dir)
        return cls(ray, namespace, temp_dir, head)

    def gpus(self) -> int:
        return int(self.ray.cluster_resources().get("GPU", 0))

    def close(self) -> None:
        """Disconnect; an owned Ray is shut down and its session folder removed."""
        with contextlib.suppress(Exception):
            self.ray.shutdown()
        if self.head is not None:
            self.head.stop()
        if self.temp_dir is not None:
            left = processes_of(self.temp_dir)
            if left:     # ray.shutdown kills what it started; make sure of it
                import psutil
                for pid in left:
                    with contextlib.suppress(psutil.Error):
                        psutil.Process(pid).kill()
                log.warning("killed %d Ray process(es) left after shutdown", len(left))
            shutil.rmtree(self.temp_dir, ignore_errors=True)
