"""The step profiler in process (`vconsole.engine.worker.profiler`, `EngineCore.start_profile`,
`vconsole.engine.process.profile_book.ProfileBook`): labels exist only while a profile runs, the report
names every layer type, and a profiler that fails never fails a step."""

from __future__ import annotations

import time

import pytest
import torch

from vconsole.engine.core import EngineCore
from vconsole.engine.process.profile_book import ProfileBook
from vconsole.engine.worker import profiler as profiler_mod
from vconsole.engine.worker.profiler import layer_type
from vconsole.engine.worker.sampler import Sampler
from vconsole.shared.config import EngineConfig
from vconsole.wire.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.mark.parametrize(("name", "kind"), [
    ("model.embed_tokens", "embedding"), ("model.layers.0.self_attn", "attention"),
    ("model.layers.3.mlp", "mlp"), ("model.layers.0.input_layernorm", "norm"),
    ("model.layers.0.post_attention_layernorm", "norm"), ("model.norm", "norm"),
    ("model.rotary_emb", "rotary"), ("lm_head", "lm_head"),
    ("model.layers.0.mlp.down_proj", None), ("model.layers.0", None)])
def test_layer_types_follow_the_module_names(name, kind):
    module = torch.nn.Embedding(2, 2) if kind == "embedding" else torch.nn.Identity()
    assert layer_type(name, module) == kind


@pytest.fixture
def core():
    core = EngineCore(EngineConfig(num_kv_blocks=32, block_size=8, max_num_seqs=4))
    for i, ids in enumerate(PROMPTS):
        core.add_request(core.make_request(str(i), prompt_token_ids=ids,
                                           sampling=SamplingParams(max_tokens=40)))
    return core


def num_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def unlabelled(core: EngineCore) -> bool:
    runner = core.runner
    return (num_hooks(runner.model) == 0 and type(runner.sampler) is Sampler
            and "prepare" not in vars(runner))


def wait_done(prof, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not prof.done:
        assert time.monotonic() < deadline, "the report was never built"
        time.sleep(0.01)


@pytest.mark.slow
def test_labels_exist_only_while_profiling_and_every_layer_type_is_reported(core):
    core.step()
    assert unlabelled(core)
    prof = core.start_profile(3)
    assert unlabelled(core)                         # armed: nothing installed before a step
    core.step()
    assert num_hooks(core.runner.model) > 0 and prof.steps_done == 1
    while prof.steps_done < 3:
        core.step()
    assert unlabelled(core)                         # removed at the last profiled step
    wait_done(prof)
    result = prof.result
    assert prof.error is None and result is not None
    assert (result["steps"], result["first_step"], result["last_step"]) == (3, 1, 4)
    # the profiled steps are decode steps of 4 rows: all layers in one native call where it
    # runs (`native_decode`), else the fused decoder's Python layers
    layers = ({"decode_step"} if core.runner.fused_decoder.native is not None
              else {"attention", "mlp", "norm"})
    assert {"embedding", "rotary", "lm_head", "sampler", "prepare", "other"} | layers \
        == set(result["layers"])
    assert all(v >= 0 for v in result["layers"].values())
    assert not any(op["name"].startswith(profiler_mod.LABEL) for op in result["ops"])
    with pytest.raises(ValueError, match="at least 1 step"):
        core.start_profile(0)
    core.step()                                     # a finished profile is inert
    assert prof.steps_done == 3 and unlabelled(core)


@pytest.mark.slow
def test_a_profiler_that_cannot_start_fails_alone(core, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no profiler here")
    monkeypatch.setattr(profiler_mod.torch.profiler, "profile", broken)
    settled = []
    prof = core.start_profile(5, on_done=lambda: settled.append(True))
    outputs, scheduled = core.step()
    assert scheduled and outputs                    # the step ran as usual
    assert prof.done and prof.error == "RuntimeError: no profiler here" and settled == [True]
    assert unlabelled(core)
    core.start_profile(2)                           # and the next one may start


@pytest.mark.slow
def test_the_book_follows_progress_and_cancel(core):
    book = ProfileBook()
    status = book.start(core, 2)
    assert status["state"] == "running" and status["id"] == "p1"
    with pytest.raises(ValueError, match="profile p1 is running .0/2 steps done"):
        book.start(core, 2)
    core.step()
    book.after_step()
    assert book.view("p1")["steps_done"] == 1 and book.view("p1")["state"] == "running"
    core.step()
    book.after_step()
    wait_done(core.profiler)
    done = book.view("p1")
    assert done["state"] == "done" and done["profiling"] is False
    assert done["result"]["id"] == "p1" and done["result"]["steps"] == 2
    book.start(core, 10)
    core.step()
    assert book.cancel("p2")["state"] == "cancelled" and unlabelled(core)
    assert book.cancel("p1")["state"] == "done"     # a finished one is returned as is
    with pytest.raises(ValueError, match="no profile 'p9'"):
        book.cancel("p9")
    assert book.active is None
    book.start(core, 1)                             # the cancelled one let go of torch.profiler
    core.step()
    wait_done(core.profiler)
    book.after_step()
    assert book.view("p3")["state"] == "done"
