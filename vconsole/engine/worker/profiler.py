"""Profile on demand: `torch.profiler` over the engine's next N steps, and where the time went.

`StepProfiler` is made by `EngineCore.start_profile` and driven by `EngineCore.step`:
`begin_step` before a step's schedule phase, `end_step` after its update phase, both on the busy
loop between the phase timers, so the step's own `StepStats` never include the profiler's
start or stop. The first `begin_step` starts the profiler and installs the labels; the N-th
`end_step` stops it and removes every label. The report (`result`) is built from the trace on a
thread of its own (``engine-profile-report``; seconds for a long trace), so the busy loop goes
on serving meanwhile; ``on_done`` is called once the profile is over, from that thread (or from
the busy loop when it failed or was cancelled).

Labels exist only while a profile runs: forward hooks on the model's modules (each call becomes
a ``record_function`` range ``vconsole.layer::TYPE``) and wrappers around the runner's input
preparation and sampler, all removed at the last profiled step (or `cancel`). An engine that is
not profiling runs exactly the code it always runs.

Layer types come from the module tree by the names transformers' Llama-family models use
(``embed_tokens``, ``self_attn``, ``mlp``, ``*norm``, ``rotary_emb``, ``lm_head``), and a decode
step that ran every layer in one native call (`native_decode`) is ``decode_step``; a module
inside one that is already labelled is not labelled again, so types never overlap. A type's time
is the inclusive time of its ranges: CUDA time when the model runs on CUDA (the CPU time of a
range there is only the kernel launches), CPU time otherwise, where ``other`` is the rest of the
execute phase (host-side bookkeeping outside every labelled range).

Invariants: every method runs on the busy loop's thread; none raises (a failing profiler sets
``error`` and stops, it never fails a step); ``done`` is set once, after ``result`` (plain data,
msgpack-able) or ``error``; ``on_done`` runs once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity

from vconsole.shared.stats import StepStats

log = logging.getLogger(__name__)

LABEL = "vconsole.layer::"
TOP_OPS = 20
PHASES = ("schedule", "execute", "update", "structured")
LAYER_NAMES = {"embed_tokens": "embedding", "wte": "embedding", "self_attn": "attention",
               "attn": "attention", "mlp": "mlp", "feed_forward": "mlp",
               "rotary_emb": "rotary", "lm_head": "lm_head"}


def layer_type(name: str, module: torch.nn.Module) -> str | None:
    """The layer type a module's calls are charged to, or None (its parent's type, if any)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in LAYER_NAMES:
        return LAYER_NAMES[leaf]
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if "norm" in leaf.lower() or "norm" in type(module).__name__.lower():
        return "norm"
    return None


class _Labelled:
    """A callable run inside a ``record_function`` range (the runner's sampler, `prepare`)."""

    def __init__(self, inner: Callable[..., Any], label: str) -> None:
        self.inner = inner
        self.label = label

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(self.label):
            return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class StepProfiler:
    """One profile of ``num_steps`` engine steps of ``runner`` (a `ModelRunner`).

    ``steps_done`` counts finished profiled steps; ``done`` is set after the last one, with
    ``result`` (or ``error``); ``first_step`` / ``last_step`` are the engine's step counts
    before the first and after the last profiled step (profiled: ``first_step + 1 ..
    last_step``)."""

    def __init__(self, runner: Any, num_steps: int,
                 on_done: Callable[[], None] | None = None) -> None:
        if num_steps < 1:
            raise ValueError(f"a profile needs at least 1 step, got {num_steps}")
        self.runner = runner
        self.num_steps = num_steps
        self.steps_done = 0
        self.done = False
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.on_done = on_done
        self._settle_lock = threading.Lock()
        device = getattr(runner, "device", torch.device("cpu"))
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self._prof: torch.profiler.profile | None = None
        self._hooks: list[Any] = []
        self._open: list[record_function] = []
        self._wrapped: list[tuple[Any, str]] = []
        self._phase_ns = dict.fromkeys(PHASES, 0)
        self._t0 = 0.0

    # --- the busy loop's hooks ------------------------------------------------------------------

    def begin_step(self, num_steps_before: int) -> None:
        """Before a step's schedule phase; the first call starts the profiler."""
        if self.done or self.first_step is not None:
            return
        try:
            self._install_labels()
            activities = [ProfilerActivity.CPU]
            if self.cuda:
                activities.append(ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()
        except Exception as e:
            self._fail(e)
            return
        self.first_step = num_steps_before
        self._t0 = time.monotonic()

    def end_step(self, stats: StepStats | None, num_steps_after: int) -> None:
        """After a step's update phase; the N-th call stops the profiler, removes the labels
        and hands the trace to the report thread."""
        if self.done or self._prof is None:
            return
        if stats is not None:
            self._phase_ns["schedule"] += stats.schedule_ns
            self._phase_ns["execute"] += stats.execute_ns
            self._phase_ns["update"] += stats.update_ns
            self._phase_ns["structured"] += stats.structured_ns
        self.steps_done += 1
        self._close_open_ranges()      # a model execution that raised left its ranges open
        if self.steps_done < self.num_steps:
            return
        self.last_step = num_steps_after
        wall_s = time.monotonic() - self._t0
        prof = self._prof
        try:
            prof.stop()
            self._prof = None
            self._remove_labels()
        except Exception as e:
            self._fail(e)
            return
        threading.Thread(target=self._build_report, args=(prof, wall_s),
                         name="engine-profile-report", daemon=True).start()

    def cancel(self) -> None:
        """Stop now, without a result; safe at any point (a report being built is dropped)."""
        if self.done:
            return
        self._stop_quietly()
        self._settle(None, "cancelled")

    @property
    def reporting(self) -> bool:
        """Every step profiled, the report not built yet."""
        return self.steps_done >= self.num_steps and not self.done

    def _build_report(self, prof: torch.profiler.profile, wall_s: float) -> None:
        try:
            result = self._report(prof, wall_s)
        except Exception as e:
            log.exception("profiler: building the report failed")
            self._settle(None, f"{type(e).__name__}: {e}")
            return
        self._settle(result, None)

    def _settle(self, result: dict[str, Any] | None, error: str | None) -> None:
        """The profile is over: set ``result`` or ``error``, then ``done``, then ``on_done``;
        only the first call counts."""
        with self._settle_lock:
            if self.done:
                return
            self.result, self.error = result, error
            self.done = True
        if self.on_done is not None:
            try:
                self.on_done()
            except Exception:
                log.exception("profiler: on_done failed")

    # --- labels -------------------------------------------------------------------------------

    def _install_labels(self) -> None:
        model = self.runner.model
        labelled: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(p + ".") for p in labelled):
                continue
            kind = layer_type(name, module) if name else None
            if kind is None:
                continue
            labelled.append(name)
            self._hooks.append(module.register_forward_pre_hook(self._enter(LABEL + kind)))
            self._hooks.append(module.register_forward_hook(self._exit))
        targets = [(self.runner, "sampler", "sampler"), (self.runner, "prepare", "prepare")]
        fused = getattr(self.runner, "fused_decoder", None)
        if fused is not None:  # our own forward calls no attention / mlp / norm module
            targets += [(fused, "attention", "attention"), (fused, "mlp", "mlp"),
                        (fused, "norm", "norm")]
            if getattr(fused, "native", None) is not None:   # every layer in one call (#47)
                targets.append((fused.native, "layers", "decode_step"))
        for obj, attr, kind in targets:
            inner = getattr(obj, attr, None)
            if inner is not None:
                setattr(obj, attr, _Labelled(inner, LABEL + kind))
                self._wrapped.append((obj, attr))

    def _enter(self, label: str) -> Callable[..., None]:
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            rf = record_function(label)
            rf.__enter__()
            self._open.append(rf)
        return pre_hook

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def _close_open_ranges(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)

    def _remove_labels(self) -> None:
        self._close_open_ranges()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for obj, attr in self._wrapped:
            wrapper = obj.__dict__.get(attr)
            if isinstance(wrapper, _Labelled):
                if attr in type(obj).__dict__:     # a method: drop the instance shadow
                    del obj.__dict__[attr]
                else:
                    setattr(obj, attr, wrapper.inner)
        self._wrapped.clear()

    def _stop_quietly(self) -> None:
        try:
            if self._prof is not None:
                self._prof.stop()
        except Exception:
            log.exception("profiler: stopping torch.profiler failed")
        self._prof = None
        try:
            self._remove_labels()
        except Exception:
            log.exception("profiler: removing the layer labels failed")

    def _fail(self, e: Exception) -> None:
        log.exception("profiler failed; the engine goes on without it")
        self._stop_quietly()
        self._settle(None, f"{type(e).__name__}: {e}")

    # --- the report ---------------------------------------------------------------------------

    def _report(self, prof: torch.profiler.profile, wall_s: float) -> dict[str, Any]:
        ops: list[dict[str, Any]] = []
        layers: dict[str, float] = {}
        for row in prof.key_averages():
            if getattr(row, "device_type", None) not in (None, torch.autograd.DeviceType.CPU):
                continue    # a kernel or GPU-side range: already in its CPU op's CUDA times
            self_cuda = _self_device_us(row) if self.cuda else 0.0
            if row.key.startswith(LABEL):
                kind = row.key[len(LABEL):]
                total_us = _device_us(row) if self.cuda else row.cpu_time_total
                layers[kind] = layers.get(kind, 0.0) + total_us / 1e6
                continue
            ops.append({"name": row.key, "self_cpu_s": row.self_cpu_time_total / 1e6,
                        "self_cuda_s": self_cuda / 1e6, "calls": int(row.count)})
        sort_by = "self_cuda_s" if self.cuda else "self_cpu_s"
        ops.sort(key=lambda op: (op[sort_by], op["self_cpu_s"]), reverse=True)
        phase_s = {p: ns / 1e9 for p, ns in self._phase_ns.items()}
        busy_s = sum(phase_s.values())
        if not self.cuda:
            layers["other"] = max(0.0, phase_s["execute"] - sum(layers.values()))
        layers = dict(sorted(layers.items(), key=lambda kv: kv[1], reverse=True))
        mean_step_s = busy_s / self.steps_done if self.steps_done else 0.0
        return {
            "steps": self.steps_done,
            "first_step": self.first_step, "last_step": self.last_step,
            "device": "cuda" if self.cuda else "cpu",
            "sort_by": sort_by,
            "ops": ops[:TOP_OPS],
            "phases": {p: (s / busy_s if busy_s else 0.0) for p, s in phase_s.items()},
            "phase_s": phase_s,
            "layers": layers,
            "layers_clock": "cuda" if self.cuda else "cpu",
            "wall_s": wall_s,
            "mean_step_s": mean_step_s,
            "slowdown_note": (
                f"profiled steps run slower than usual: torch.profiler recorded every "
                f"operator ({'CPU and CUDA' if self.cuda else 'CPU'}) and every layer was "
                f"labelled (mean step {mean_step_s * 1e3:.1f} ms over these "
                f"{self.steps_done}); operator times include the profiler's overhead, and "
                "building this report after the last step slowed the engine a little longer"),
        }


def _self_device_us(row: Any) -> float:
    value = getattr(row, "self_device_time_total", None)
    return float(value if value is not None else getattr(row, "self_cuda_time_total", 0.0))


def _device_us(row: Any) -> float:
    value = getattr(row, "device_time_total", None)
    return float(value if value is not None else getattr(row, "cuda_time_total", 0.0))
