"""NVTX ranges for Nsight Systems: the step's phases and each decoder layer, named on the timeline.

With the hot key ``nvtx`` on (``--set nvtx=true``) on a CUDA engine, `EngineCore.step` wraps
``step``, ``schedule``, ``execute`` and ``update`` in NVTX ranges, and, inside ``execute``, the
fused decoder (`vconsole.engine.worker.fused_decoder`, the Llama family's forward) wraps each
layer (``layer 0`` …), so ``nsys profile -t cuda,nvtx`` shows where every kernel of a step
belongs. Layer ranges exist only on that fused path: a model run through transformers' own
forward (another architecture, ``VCONSOLE_FORWARD=transformers``) has the four phase ranges
only. The final norm and the logits (``lm_head``) have no range of their own: they fall in
``execute``. `capture_start` / `capture_stop` are
``cudaProfilerStart/Stop``: with ``nsys profile --capture-range=cudaProfilerApi`` only the steps
between them are recorded (`vconsole profile --nsys`, `vconsole.engine.process.profile_book`).

Cost when off: `push` and `pop` are module-level names bound to a function that does nothing
(callers write ``nvtx.push("execute")``, one call of an empty function); `configure` rebinds
them to ``torch.cuda.nvtx.range_push`` / ``range_pop`` when on and back when off. The decoder's
per-layer loop checks `ON` once per step, so an engine without ranges runs its plain loop.
Elsewhere (CPU) ranges stay off whatever the key says: NVTX needs CUDA.

The backend is ``torch.cuda.nvtx`` (and ``torch.cuda.cudart()`` for the capture range);
`use_backend` puts another object with the same functions in its place (a test's recorder on a
CPU machine). Invariants: only the busy loop calls `configure` (between steps); `push`/`pop`
are balanced within a step, also when a phase raises (the callers use ``try``/``finally``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def _push_nothing(_name: str) -> None:
    return None


def _pop_nothing() -> None:
    return None


push: Callable[[str], Any] = _push_nothing
pop: Callable[[], Any] = _pop_nothing
ON = False                      # ranges being emitted now
_backend: Any = None            # a stand-in for torch.cuda.nvtx (+ cudart), see `use_backend`


def use_backend(backend: Any) -> None:
    """Emit through ``backend`` (``range_push(name)``, ``range_pop()``, and for the capture
    range ``profiler_start()`` / ``profiler_stop()``) instead of CUDA's; None: CUDA's again.
    Ranges then turn on at the next `configure` with ``on``, whatever the device."""
    global _backend
    _backend = backend
    configure(False, "cpu")


def available(device_type: str) -> str | None:
    """Why NVTX ranges cannot be emitted on ``device_type`` (None: they can)."""
    if _backend is not None:
        return None
    if device_type != "cuda":
        return f"NVTX ranges need CUDA; this engine runs on {device_type}"
    try:
        import torch

        torch.cuda.nvtx.range_push   # noqa: B018 - present in every CUDA build of torch
    except (ImportError, AttributeError) as e:
        return f"torch has no NVTX support here: {e}"
    return None


def configure(on: bool, device_type: str) -> bool:
    """Ranges on or off (the ``nvtx`` key, at start and at each change); whether they are on."""
    global push, pop, ON
    if on and (why := available(device_type)) is not None:
        log.warning("nvtx=true has no effect: %s", why)
        on = False
    if on:
        if _backend is not None:
            push, pop = _backend.range_push, _backend.range_pop
        else:
            import torch
            push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    else:
        push, pop = _push_nothing, _pop_nothing
    if on != ON:
        log.info("NVTX ranges %s", "on (step, schedule, execute, update; each layer on the "
                 "fused decoder)"
                 if on else "off")
    ON = on
    return on


def capture_start(device_type: str) -> None:
    """``cudaProfilerStart``: nsys with ``--capture-range=cudaProfilerApi`` records from here.
    Raises ValueError where there is no CUDA (the reason)."""
    if _backend is not None:
        _backend.profiler_start()
        return
    if (why := available(device_type)) is not None:
        raise ValueError(why.replace("NVTX ranges need", "an nsys capture range needs"))
    import torch
    torch.cuda.cudart().cudaProfilerStart()


def capture_stop(device_type: str) -> None:
    """``cudaProfilerStop``: the capture range ends (nsys then writes its report)."""
    if _backend is not None:
        _backend.profiler_stop()
        return
    if available(device_type) is None:
        import torch
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
