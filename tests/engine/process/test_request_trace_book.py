"""The request trace's book (`vconsole.engine.process.request_trace.TraceBook`) without an
engine: the busy loop's call only hands over (no hashing, no JSON, no I/O); the records are
made later, in order, with periods, config versions and the window as the format says."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from vconsole.engine.process import request_trace as book_module
from vconsole.engine.process.request_trace import TraceBook, open_trace_file
from vconsole.engine.request import FinishReason
from vconsole.shared.config import EngineConfig
from vconsole.shared.stats import StepStats
from vconsole.telemetry.request_trace import (
    TraceHeader,
    parse_lines,
    prompt_block_hashes,
    read_trace,
)
from vconsole.wire.sampling import SamplingParams

BLOCK = 4


def book(**kw) -> TraceBook:
    header = TraceHeader(model="tiny", block_size=BLOCK, num_kv_blocks=64)
    return TraceBook(header, EngineConfig(block_size=BLOCK), 1, **kw)


def step(b: TraceBook, at: float, *, prefill: int = 0, decode: int = 1, left: int = 1,
         dur: float = 0.001) -> StepStats:
    """A step that began ``at`` seconds after the book's t0."""
    return StepStats(schedule_ns=0, execute_ns=int(dur * 1e9), update_ns=0,
                     total_ns=int(dur * 1e9), num_prefill_tokens=prefill,
                     num_decode_tokens=decode, num_reqs=max(1, decode),
                     start_ns=int((b.t0 + at) * 1e9), num_running=left, kv_used_blocks=3)


def request(b: TraceBook, prompt: list[int], arrival: float, finish: float,
            output_len: int = 3) -> SimpleNamespace:
    """A finished request as the scheduler leaves it (read by attribute, like a Request)."""
    return SimpleNamespace(
        prompt_token_ids=prompt, output_token_ids=[7] * output_len,
        arrival_time=b.t0 + arrival, first_token_time=b.t0 + arrival + 0.01,
        last_token_time=b.t0 + finish, token_gaps=[0.002] * (output_len - 1),
        sampling=SamplingParams(max_tokens=output_len, ignore_eos=True), priority=2,
        finish_reason=FinishReason.LENGTH, num_preemptions=0, num_cached_tokens=0)


def test_the_busy_loops_call_only_appends_and_the_records_come_later(monkeypatch):
    b = book()
    made = {"hash": 0, "line": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            made[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(book_module, "prompt_block_hashes",
                        counted("hash", book_module.prompt_block_hashes))
    for name in ("step_line", "request_line", "header_line", "config_line"):
        monkeypatch.setattr(book_module, name, counted("line", getattr(book_module, name)))
    finished = [request(b, list(range(10)), 0.0, 0.5)]
    for i in range(10_000):
        b.add_step(step(b, i * 1e-5), finished if i % 10 == 9 else [], 1)
    assert made == {"hash": 0, "line": 0}
    assert len(b._inbox) == 10_000                  # handed over, nothing made yet

    trace = parse_lines(b.lines().splitlines(keepends=True))
    assert made["hash"] == 1_000 and made["line"] > 11_000
    assert (len(trace.requests), len(trace.steps)) == (1_000, 10_000)
    assert trace.requests[0].block_hashes == trace.requests[-1].block_hashes
    assert len(trace.requests[0].block_hashes) == 10 // BLOCK
    assert trace.requests[0].itl_us == [2000, 2000] and trace.requests[0].priority == 2


def test_a_steps_period_runs_to_the_next_step_only_when_the_engine_went_straight_on():
    b = book()
    b.add_step(step(b, 1.0, prefill=8, decode=0), [], 1)      # requests left
    b.add_step(step(b, 1.01), [], 1)                         # left -> then a stall:
    b.add_step(step(b, 1.02, decode=0), [], 1)               # nothing scheduled: no record
    b.add_step(step(b, 1.03), [], 1)
    b.add_step(step(b, 1.04, left=0), [], 1)                  # nothing left: the engine idles
    b.add_step(step(b, 2.0), [request(b, [1, 2, 3, 4, 5], 1.5, 2.0)], 1)
    trace = parse_lines(b.lines().splitlines(keepends=True))
    periods = [s.period for s in trace.steps]
    assert [round(s.t, 6) for s in trace.steps] == [1.0, 1.01, 1.03, 1.04, 2.0]
    assert periods[0] == pytest.approx(0.01, abs=1e-6)
    assert periods[1:4] == [None, pytest.approx(0.01, abs=1e-6), None]
    assert periods[4] is None                                 # its next step has not come yet
    assert trace.steps[0].prefill == 8 and trace.steps[0].kv_used == 3


def test_config_changes_are_lines_and_each_request_carries_its_version():
    b = book()
    b.add_step(step(b, 0.1, left=0), [request(b, [1] * 8, 0.0, 0.1)], 1)
    b.config_changed(2, EngineConfig(block_size=BLOCK, max_num_seqs=3))
    b.add_step(step(b, 0.2, left=0), [request(b, [1] * 8, 0.15, 0.2)], 2)
    trace = parse_lines(b.lines().splitlines(keepends=True))
    assert trace.header.config_version == 1 and trace.header.config["max_num_seqs"] == 64
    assert trace.configs[2]["max_num_seqs"] == 3
    assert [r.config_version for r in trace.requests] == [1, 2]


def test_the_window_keeps_the_last_seconds_and_the_config_in_force_then():
    b = book(window_s=10.0)
    b.add_step(step(b, -30.0, left=0), [request(b, [1] * 8, -31.0, -30.0)], 1)
    b.config_changed(2, EngineConfig(block_size=BLOCK, max_num_seqs=5))
    time.sleep(0.01)
    b.add_step(step(b, 0.0, left=0), [request(b, [2] * 8, -1.0, 0.0)], 2)
    trace = parse_lines(b.lines().splitlines(keepends=True))
    assert len(trace.requests) == 1 and len(trace.steps) == 1
    assert trace.requests[0].config_version == 2 and trace.header.config_version == 1
    narrow = b.lines(window_s=1e-3)                # nothing finished in the last millisecond
    assert '"kind":"request"' not in narrow and narrow.startswith('{"kind":"header"')


def test_the_file_gets_the_header_then_whole_lines_and_is_closed(tmp_path):
    b = book(poll_s=0.02)
    path = tmp_path / "trace.jsonl"
    b.add_step(step(b, 0.0, left=0), [request(b, [3] * 8, -0.5, 0.0)], 1)   # before the file
    b.use_file(open_trace_file(str(path)), str(path))
    b.start()
    b.add_step(step(b, 0.1), [], 1)
    b.add_step(step(b, 0.2, left=0), [request(b, [4] * 9, 0.05, 0.2)], 1)
    b.close()
    trace = read_trace(path)
    assert [r.prompt_len for r in trace.requests] == [9]
    assert [s.period for s in trace.steps] == [pytest.approx(0.1, abs=1e-6), None]
    assert path.read_bytes().endswith(b"\n")


def test_a_trace_file_that_cannot_be_written_is_refused_with_the_reason(tmp_path):
    with pytest.raises(OSError, match="cannot write the request trace to .*No such file"):
        open_trace_file(str(tmp_path / "missing" / "trace.jsonl"))
    with pytest.raises(OSError, match="Is a directory"):
        open_trace_file(str(tmp_path))


def test_prompt_hashes_are_the_chain_over_little_endian_ids():
    """The format's hashes, byte for byte: block i's is BLAKE2b-64 of block i-1's digest and
    block i's ids as 4-byte little-endian integers (so any reader can recompute them)."""
    import hashlib
    import random

    rng = random.Random(3)
    for n in (0, 3, 4, 17, 64):
        ids = [rng.randrange(0, 1 << 31) for _ in range(n)]
        for size in (1, 4, 16):
            want, parent = [], b""
            for i in range(n // size):
                block = b"".join(t.to_bytes(4, "little") for t in ids[i * size:(i + 1) * size])
                h = hashlib.blake2b(parent + block, digest_size=8)
                parent = h.digest()
                want.append(h.hexdigest())
            assert prompt_block_hashes(ids, size) == want


def test_a_snapshot_copies_made_lines_and_the_hashes_are_keyed_per_book():
    """``get_trace`` joins lines the trace thread already made (the lock is held for a
    copy, not for serializing the window); two books hash the same prompt differently, each
    consistently, so prefix sharing shows within a trace and nothing can be tested against
    a guessed prompt."""
    b, other = book(), book()
    ids = list(range(40))
    for bk in (b, other):
        finished = [request(bk, ids, 0.0, 0.5), request(bk, ids + [7] * 8, 0.1, 0.6)]
        bk.add_step(step(bk, 1e-3), finished, 1)
        bk._drain()
    made = {"n": 0}
    real = book_module.request_line

    def counting(r):
        made["n"] += 1
        return real(r)

    book_module.request_line = counting
    try:
        first = parse_lines(b.lines().splitlines(keepends=True))
    finally:
        book_module.request_line = real
    assert made["n"] == 0                       # nothing serialized again for a snapshot
    second = parse_lines(other.lines().splitlines(keepends=True))
    a, c = first.requests
    assert a.block_hashes == c.block_hashes[:len(a.block_hashes)]   # shared prefix: equal
    assert a.block_hashes != second.requests[0].block_hashes          # another book's key
    assert a.block_hashes != prompt_block_hashes(ids, BLOCK)          # not the unkeyed hash
    assert first.header.records_lost == 0
