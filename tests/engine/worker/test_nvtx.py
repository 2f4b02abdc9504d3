"""NVTX ranges (`vconsole.engine.worker.nvtx`): no-ops while ``nvtx`` is off, each step's phases
and each decoder layer in balanced ranges once it is turned on (hot), off again when turned off.

A real engine core on the CPU, real steps; the one stand-in is the NVTX module itself (a
recorder in place of ``torch.cuda.nvtx``, which needs CUDA), put in through `nvtx.use_backend`.
"""

from __future__ import annotations

import pytest

from vconsole import cli
from vconsole.engine.core import EngineCore
from vconsole.engine.process.profile_book import ProfileBook
from vconsole.engine.worker import nvtx
from vconsole.shared.config import EngineConfig
from vconsole.wire.sampling import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]


class RecordingNvtx:
    """``torch.cuda.nvtx``'s range functions and the capture range, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def range_push(self, name: str) -> int:
        self.calls.append(f"push {name}")
        return 0

    def range_pop(self) -> int:
        self.calls.append("pop")
        return 0

    def profiler_start(self) -> None:
        self.calls.append("profiler start")

    def profiler_stop(self) -> None:
        self.calls.append("profiler stop")


@pytest.fixture(scope="module")
def core() -> EngineCore:
    c = EngineCore(EngineConfig(model="tiny", device="cpu", num_kv_blocks=32, block_size=8))
    yield c
    c.close()


@pytest.fixture
def recorder():
    rec = RecordingNvtx()
    nvtx.use_backend(rec)
    yield rec
    nvtx.use_backend(None)


def run_one_request(core: EngineCore, rid: str) -> int:
    core.add_request(core.make_request(rid, prompt_token_ids=PROMPT, sampling=SamplingParams(
        max_tokens=3, ignore_eos=True)))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    return steps


def test_ranges_are_no_ops_while_off(core, recorder, monkeypatch):
    """Both ways NVTX could be reached lead to the recorder while the key is off: the backend
    (`use_backend`) and CUDA's own module (``torch.cuda.nvtx``, bound to the recorder's
    functions here), so an off path that pushed any range would be seen."""
    import torch

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", recorder.range_push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", recorder.range_pop)
    torch.cuda.nvtx.range_push("probe")
    torch.cuda.nvtx.range_pop()
    assert recorder.calls == ["push probe", "pop"], "the recorder sees CUDA's NVTX calls"
    recorder.calls.clear()
    assert not core.config.nvtx
    steps = run_one_request(core, "off")
    assert steps == 3 and recorder.calls == []
    assert nvtx.push is nvtx._push_nothing and not nvtx.ON
    assert core.apply_config({"nvtx": True}).applied          # the same bindings, on: seen
    try:
        run_one_request(core, "on-once")
    finally:
        assert core.apply_config({"nvtx": False}).applied
    assert recorder.calls.count("push step") == 3


def test_turned_on_hot_every_phase_and_layer_is_a_balanced_range(core, recorder):
    assert core.apply_config({"nvtx": True}).applied
    try:
        steps = run_one_request(core, "on")
    finally:
        assert core.apply_config({"nvtx": False}).applied
    calls = recorder.calls
    assert calls.count("push step") == steps == 3          # a prefill, then two decodes
    layers = [f"push layer {i}" for i in range(core.runner.num_layers)]
    first = calls[:calls.index("pop", calls.index("push update")) + 2]
    assert [c for c in first if c != "pop"] == ["push step", "push schedule", "push execute",
                                                *layers, "push update"]
    depth = 0
    for c in calls:                      # balanced: never below zero, zero at the end
        depth += -1 if c == "pop" else 1
        assert depth >= 0
    assert depth == 0
    recorder.calls.clear()
    run_one_request(core, "off-again")
    assert recorder.calls == [], "off again: nothing emitted"


def test_on_a_cpu_engine_without_nvtx_the_key_changes_nothing(core, caplog):
    assert nvtx.available("cpu") is not None
    assert core.apply_config({"nvtx": True}).applied
    try:
        assert not nvtx.ON and nvtx.pop is nvtx._pop_nothing
        assert "NVTX ranges need CUDA" in caplog.text
        run_one_request(core, "cpu")             # and it serves as before
        with pytest.raises(ValueError, match="needs CUDA"):
            nvtx.capture_start("cpu")
    finally:
        core.apply_config({"nvtx": False})


# --- `vconsole profile --nsys`: the capture range around the next N steps ----------------------

def test_an_nsys_capture_range_opens_now_and_closes_after_n_steps(core, recorder):
    book = ProfileBook()
    status = book.start(core, 2, nsys=True)
    assert status["state"] == "running" and status["kind"] == "nsys"
    assert recorder.calls == ["profiler start"]          # open at once, between two steps
    core.add_request(core.make_request("cap", prompt_token_ids=PROMPT,
                                       sampling=SamplingParams(max_tokens=4, ignore_eos=True)))
    for _ in range(3):
        core.step()
        book.after_step()
    while core.has_unfinished_requests():
        core.step()
    assert recorder.calls == ["profiler start", "profiler stop"]    # closed after step 2
    done = book.view(status["id"])
    assert done["state"] == "done" and book.active is None
    assert done["result"]["kind"] == "nsys" and done["result"]["steps"] == 2
    cancelled = book.start(core, 5, nsys=True)
    book.cancel(None)
    assert recorder.calls[-1] == "profiler stop"
    assert book.view(cancelled["id"])["state"] == "cancelled"


@pytest.mark.proc
def test_profile_nsys_on_a_cpu_engine_is_refused_with_the_reason(shared_engine, capsys):
    code = cli.main(["profile", "--nsys", "--steps", "2",
                     "--control", shared_engine.endpoints["control"],
                     "--control-key-file", str(shared_engine.control_key_file)])
    err = capsys.readouterr().err
    assert code == 1 and "an nsys capture range needs CUDA; this engine runs on cpu" in err
