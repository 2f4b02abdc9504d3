"""Helpers for tests that run the engine as a process (`vconsole.engine.launch.engine_process.EngineProcess`).

`Telemetry` keeps every decoded telemetry message from a SUB thread; `RssSampler` follows the
engine process's resident memory from a thread (psutil); `reference_outputs` computes greedy
outputs with an in-process `EngineCore`, the figures a live engine must reproduce.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from vconsole.telemetry import schema
from vconsole.telemetry.listener import TelemetryListener

ENDPOINT_NAMES = ("input", "output", "telemetry", "control")


def ipc_endpoints(folder: str | Path) -> dict[str, str]:
    return {n: f"ipc://{folder}/{n}" for n in ENDPOINT_NAMES}


class Telemetry:
    """Every telemetry message, decoded, as ``(monotonic time, topic, payload)``, from a SUB
    thread of its own (a ``kv`` payload keeps a copy of its block states)."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[tuple[float, str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._listener = TelemetryListener(endpoint, self._on_message)

    def _on_message(self, msg: schema.TelemetryMessage) -> None:
        payload = dict(msg.payload)
        if msg.topic == "kv":
            payload["block_states"] = msg.block_states().copy()
        with self._lock:
            self.messages.append((time.monotonic(), msg.topic, payload))

    def topic(self, name: str, since: float = 0.0) -> list[dict[str, Any]]:
        with self._lock:
            return [p for t, topic, p in self.messages if topic == name and t >= since]

    def wait_for(self, name: str, pred: Callable[[dict[str, Any]], bool],
                 timeout_s: float = 10.0, since: float = 0.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.topic(name, since):
                if pred(p):
                    return p
            time.sleep(0.05)
        raise AssertionError(f"no {name} message matched within {timeout_s} s")

    def close(self) -> None:
        self._listener.close(None)


class RssSampler:
    """The resident memory of process ``pid``, sampled every ``interval_s`` while running."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.rss())
            except psutil.Error:
                return
            self._stop.wait(self.interval_s)

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def reference_outputs(work: list[tuple[list[int], int]], *, block_size: int = 8,
                      num_kv_blocks: int = 64) -> list[list[int]]:
    """Greedy outputs of ``(prompt token ids, max_tokens)`` through an in-process EngineCore
    with the tiny model, on one thread (the other core stays with the engine process)."""
    import torch

    from vconsole.engine.core import EngineCore
    from vconsole.shared.config import EngineConfig
    from vconsole.wire.sampling import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        core = EngineCore(EngineConfig(num_kv_blocks=num_kv_blocks, block_size=block_size,
                                       max_num_seqs=16))
        for i, (ids, max_tokens) in enumerate(work):
            core.add_request(core.make_request(str(i), prompt_token_ids=ids,
                                               sampling=SamplingParams(max_tokens=max_tokens)))
        results: dict[str, list[int]] = {str(i): [] for i in range(len(work))}
        while core.has_unfinished_requests():
            outputs, _ = core.step()
            for outs in outputs.values():
                for out in outs:
                    results[out.request_id].extend(out.new_token_ids)
    finally:
        torch.set_num_threads(threads)
    return [results[str(i)] for i in range(len(work))]


def wait_for_steps(endpoint: str, steps: int = 20, timeout_ms: int = 60_000) -> None:
    """Until the engine's health on ``endpoint`` counts more than ``steps`` steps (a load is
    being served); AssertionError when nothing comes for ``timeout_ms``."""
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"health")
    sub.connect(endpoint)
    try:
        while sub.poll(timeout_ms):
            if schema.decode(sub.recv_multipart()).payload["steps"] > steps:
                return
        raise AssertionError("the engine never stepped")
    finally:
        sub.close(0)


def load_with_engine_killed(endpoints: dict[str, str], engine_pid: int,
                            load_args: list[str]) -> tuple[int, str, str]:
    """Run ``vconsole load`` against ``endpoints`` with ``load_args``, SIGKILL the engine once
    the load is being served, and return the load's (exit code, stdout, stderr)."""
    return load_with_kill(endpoints, lambda: [engine_pid], load_args)


def publisher_process_pid(engine_pid: int) -> int:
    """The telemetry publisher process of the engine ``engine_pid`` (the engine process, or
    its supervisor: the publisher is then the supervised engine's child)."""
    for child in psutil.Process(engine_pid).children(recursive=True):
        if "vconsole.engine.publish.publisher_child" in " ".join(child.cmdline()):
            return child.pid
    raise AssertionError(f"engine {engine_pid} has no publisher process")


def load_with_kill(endpoints: dict[str, str], victims: Callable[[], list[int]],
                   load_args: list[str], *, after_steps: int = 20,
                   timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run ``vconsole load`` against ``endpoints`` with ``load_args``; once the engine has
    stepped ``after_steps`` times under it, SIGKILL every pid ``victims()`` names; return the
    load's (exit code, stdout, stderr) — killed, with code None, if it ran past ``timeout_s``."""
    import os
    import signal
    import subprocess
    import sys

    load = subprocess.Popen(
        [sys.executable, "-m", "vconsole", "load", "--input", endpoints["input"], "--output",
         endpoints["output"], *load_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(endpoints["telemetry"], after_steps)
        for pid in victims():
            os.kill(pid, signal.SIGKILL)
        out, err = load.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        load.kill()
        out, err = load.communicate()
        return None, out, err  # type: ignore[return-value]
    finally:
        if load.poll() is None:
            load.kill()
    return load.returncode, out, err
