"""Where an engine's `EngineConfig` comes from: a TOML file, the command line's flags and
``--set KEY=VALUE``, in that order.

Why apart from the table (`vconsole.shared.config`): the table is plain data the console and the
wire share; reading files and flags is the engine's launching side only.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vconsole.shared.config import ConfigError, EngineConfig, validate_config


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into raw values. Tables are flattened one level so both
    ``max_num_seqs = 8`` and ``[scheduler]\\nmax_num_seqs = 8`` work."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    return flat


# Config keys that have a flag of their own (``--max-num-seqs``); the rest go through --set.
FLAG_KEYS = ("model", "device", "dtype", "block_size", "num_kv_blocks", "kv_cache_dtype",
             "kv_cache_memory_bytes", "quantization", "max_num_seqs",
             "max_num_batched_tokens", "max_model_len", "policy", "data_parallel_size", "dp_rank",
             "dp_master_addr", "dp_master_port", "kv_events_endpoint",
             "kv_events_replay_endpoint", "request_trace", "speculative_config")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


@dataclass(frozen=True)
class ConfigSource:
    """What an EngineConfig is built from, as the command line gave it: defaults <
    ``--config FILE`` < flags < ``--set KEY=VALUE``. A launcher keeps this rather than the built
    config, so an engine it starts reads (and reloads) the same file; `argv` gives the flags
    back."""

    flags: Mapping[str, Any] = field(default_factory=dict)   # FLAG_KEYS given, by key
    no_prefix_caching: bool = False
    config_file: str | None = None
    overrides: tuple[str, ...] = ()

    @classmethod
    def from_flags(cls, args: Any) -> ConfigSource:
        """From parsed CLI flags (an ``argparse.Namespace``; absent flags are unset)."""
        return cls(flags={k: v for k in FLAG_KEYS if (v := getattr(args, k, None)) is not None},
                   no_prefix_caching=bool(getattr(args, "no_prefix_caching", False)),
                   config_file=getattr(args, "config", None) or None,
                   overrides=tuple(getattr(args, "overrides", None) or ()))

    def build(self) -> EngineConfig:
        """The validated config: `ConfigError` says what is wrong; ValueError or OSError an
        unreadable ``--config`` file."""
        values: dict[str, Any] = load_toml(self.config_file) if self.config_file else {}
        values.update(self.flags)
        if self.no_prefix_caching:
            values["enable_prefix_caching"] = False
        for pair in self.overrides:
            key, sep, raw = pair.partition("=")
            if not sep:
                raise ConfigError({pair: "expected KEY=VALUE"})
            values[key.strip().replace("-", "_")] = raw
        return validate_config(values)

    def with_flags(self, **flags: Any) -> ConfigSource:
        return dataclasses.replace(self, flags={**self.flags, **flags})

    def argv(self) -> list[str]:
        out: list[str] = []
        for key in FLAG_KEYS:
            if self.flags.get(key) is not None:
                out += [_flag(key), str(self.flags[key])]
        if self.no_prefix_caching:
            out.append("--no-prefix-caching")
        if self.config_file:
            out += ["--config", self.config_file]
        out += [f"--set={pair}" for pair in self.overrides]
        return out


def config_from_args(args: Any) -> EngineConfig:
    """EngineConfig from the CLI's engine flags: defaults < --config FILE < flags < --set K=V."""
    return ConfigSource.from_flags(args).build()
