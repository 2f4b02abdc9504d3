"""An engine whose only request waits on its grammar's compile is waiting, not hung.

The real busy loop (in this process, real ipc:// sockets) with a liveness file, as the
supervisor starts it, and a compile made slower than the hang timeout (the compiler's
`build_matcher` hook, the real compile plus a sleep). The loop blocks on its input queue while
the compile runs, so its last pass grows older than the timeout: the stamp must say "not
busy" all that time (the supervisor's `hung_for` finds nothing), and the request then finishes
under its grammar.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from vconsole.engine.client.client import EngineClient
from vconsole.engine.core import EngineCore
from vconsole.engine.process.core_proc import EngineCoreProc
from vconsole.engine.structured.compiler import GrammarCompiler
from vconsole.shared.config import EngineConfig
from vconsole.wire import liveness

HANG_TIMEOUT_S = 0.3
COMPILE_EXTRA_S = 1.5          # five hang timeouts


@pytest.mark.proc
def test_a_loop_waiting_only_on_a_compile_is_not_taken_for_hung(tmp_path, monkeypatch):
    real_build = GrammarCompiler.build_matcher

    def slow_build(tokenizer, grammar):         # the real compile, then the stall
        matcher = real_build(tokenizer, grammar)
        time.sleep(COMPILE_EXTRA_S)
        return matcher

    monkeypatch.setattr(GrammarCompiler, "build_matcher", staticmethod(slow_build))
    core = EngineCore(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                   max_num_seqs=4, num_kv_blocks=64, block_size=8))
    stamp = tmp_path / "liveness"
    liveness.create(stamp)
    eps = {n: f"ipc://{tmp_path}/{n}" for n in ("input", "output", "telemetry", "control")}
    proc = EngineCoreProc(core.config, eps, core=core, liveness_file=stamp)
    proc.start()
    loop = threading.Thread(target=proc.run_busy_loop, name="busy-loop")
    loop.start()
    try:
        with EngineClient(eps["input"], eps["output"], timeout_s=30) as client:
            rid = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=8,
                                structured={"kind": "regex", "value": "[a-z]{3}-[0-9]{2}"})
            hung: list[float] = []
            oldest_idle_pass = 0.0
            deadline = time.monotonic() + COMPILE_EXTRA_S
            while time.monotonic() < deadline:
                age = liveness.hung_for(stamp, HANG_TIMEOUT_S)
                if age is not None:
                    hung.append(age)
                last = liveness.read(stamp)
                if last is not None and not last[1]:
                    oldest_idle_pass = max(oldest_idle_pass, time.monotonic() - last[0])
                time.sleep(0.02)
            # The loop said all along that it was not stuck in a step ...
            assert hung == [], f"the supervisor would have killed it (no pass for {hung[0]:.2f} s)"
            # ... while it really did sit still past the timeout (else this proves nothing).
            assert oldest_idle_pass > HANG_TIMEOUT_S
            done = client.gather([rid], timeout_s=30)[rid]
        assert done.finish_reason == "stop" and done.error is None
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", done.text or ""), done.text
    finally:
        proc.request_shutdown("test over")
        loop.join(30)
    assert not loop.is_alive()
