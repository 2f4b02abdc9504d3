"""The data-parallel rank's pure parts: the wave state machine, where a rank stands (flags over
torchrun's environment), and the DP messages of the request protocol."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vconsole.engine.dp.rank.rendezvous import DPEnv, rank_key
from vconsole.engine.dp.rank.wave import CompletedWave, WaveState
from vconsole.shared.config import EngineConfig
from vconsole.wire import protocol

# --- WaveState -------------------------------------------------------------------------------


def test_a_new_rank_waits_for_wave_zero():
    w = WaveState(4)
    assert (w.wave, w.running, w.steps, w.dummy_steps) == (0, False, 0, 0)


def test_sync_every_below_one_is_refused():
    with pytest.raises(ValueError, match="sync_every"):
        WaveState(0)


def test_a_local_request_starts_the_current_wave_once():
    w = WaveState(2)
    assert w.start(now=10.0) is True
    assert (w.wave, w.running, w.started_at) == (0, True, 10.0)
    assert w.start(now=11.0) is False          # already running: nothing changes
    assert w.started_at == 10.0


@pytest.mark.parametrize("sync_every", [1, 2, 3, 4, 7])
def test_the_sync_is_due_after_every_kth_step_of_the_wave(sync_every):
    w = WaveState(sync_every)
    w.start(0.0)
    due = [w.on_step(dummy=i % 2 == 0) for i in range(3 * sync_every)]
    assert [i + 1 for i, d in enumerate(due) if d] == [sync_every, 2 * sync_every,
                                                      3 * sync_every]
    assert w.steps == 3 * sync_every
    assert w.dummy_steps == sum(1 for i in range(3 * sync_every) if i % 2 == 0)


def test_steps_outside_a_wave_count_nothing_and_never_sync():
    w = WaveState(1)
    assert [w.on_step(dummy=d) for d in (True, False, True)] == [False, False, False]
    assert (w.steps, w.dummy_steps) == (0, 0)


def test_a_busy_answer_keeps_the_wave_going():
    w = WaveState(2)
    w.start(0.0)
    w.on_step(False)
    w.on_step(False)
    assert w.on_sync_result(any_busy=True, now=1.0) is None
    assert (w.wave, w.running, w.steps) == (0, True, 2)


def test_nobody_busy_completes_the_wave_with_its_figures_and_advances():
    w = WaveState(2)
    w.start(5.0)
    for dummy in (False, True, True, True):
        w.on_step(dummy)
    done = w.on_sync_result(any_busy=False, now=7.5)
    assert done == CompletedWave(wave=0, steps=4, dummy_steps=3, duration_s=2.5)
    assert (w.wave, w.running, w.steps, w.dummy_steps) == (1, False, 0, 0)
    assert w.on_sync_result(any_busy=False, now=8.0) is None   # nothing runs: nothing completes
    assert w.start(9.0) is True and w.wave == 1                 # the next wave is number 1


def test_start_wave_from_another_rank_starts_the_same_or_a_later_wave():
    w = WaveState(4)
    assert w.on_start_wave(0, now=1.0) is True
    assert (w.wave, w.running) == (0, True)
    w2 = WaveState(4)
    assert w2.on_start_wave(3, now=1.0) is True                  # a rank that fell behind
    assert (w2.wave, w2.running) == (3, True)


def test_a_stale_start_wave_is_ignored():
    w = WaveState(1)
    w.start(0.0)
    w.on_step(False)
    w.on_sync_result(False, 1.0)                                 # wave 0 done, next is 1
    assert w.on_start_wave(0, now=2.0) is False
    assert (w.wave, w.running) == (1, False)


def test_start_wave_while_running_does_not_restart_it_but_adopts_a_higher_number():
    w = WaveState(4)
    w.start(0.0)
    w.on_step(True)
    assert w.on_start_wave(0, now=1.0) is False
    assert (w.wave, w.steps) == (0, 1)
    assert w.on_start_wave(2, now=1.0) is False
    assert (w.wave, w.running, w.steps) == (2, True, 1)


def test_abandon_stops_the_wave_without_completing_it():
    w = WaveState(2)
    w.start(0.0)
    w.on_step(False)
    w.abandon()
    assert (w.wave, w.running, w.steps) == (0, False, 0)
    assert w.on_sync_result(False, 1.0) is None


def test_restart_numbering_never_goes_back():
    w = WaveState(2)
    w.start(0.0)
    w.restart_numbering(5)
    assert (w.wave, w.running) == (5, False)
    w.restart_numbering(2)
    assert w.wave == 5


@settings(max_examples=60, deadline=None)
@given(sync_every=st.integers(1, 5), num_ranks=st.integers(2, 4),
       arrivals=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 3), st.integers(1, 9)),
                         max_size=12))
def test_ranks_in_lockstep_complete_the_same_waves_at_the_same_step(sync_every, num_ranks,
                                                                    arrivals):
    """A simulated group: requests (arrival tick, rank, steps of work) reach single ranks; a
    rank that starts a wave tells the others (the front end's start_wave); every rank in a wave
    steps each tick and the all-reduce needs all of them. Every rank must see the same
    completed waves, numbered 0, 1, 2, ..., and finish all its work."""
    ranks = [WaveState(sync_every) for _ in range(num_ranks)]
    work = [0] * num_ranks
    done: list[list[int]] = [[] for _ in range(num_ranks)]
    pending = sorted((t, r % num_ranks, n) for t, r, n in arrivals)
    for tick in range(400):
        for _, r, n in [a for a in pending if a[0] == tick]:
            work[r] += n
        starts = [ranks[r].wave for r in range(num_ranks)
                  if work[r] and ranks[r].start(float(tick))]
        for w in starts:
            for other in ranks:
                other.on_start_wave(w, float(tick))
        if not any(s.running for s in ranks):
            continue
        assert all(s.running for s in ranks)           # nobody steps alone in a wave
        due = []
        for r, s in enumerate(ranks):
            dummy = work[r] == 0
            work[r] = max(0, work[r] - 1)
            due.append(s.on_step(dummy))
        assert len(set(due)) == 1                      # the all-reduce lines up
        if due[0]:
            busy = any(work)
            for r, s in enumerate(ranks):
                c = s.on_sync_result(busy, float(tick))
                if c is not None:
                    done[r].append(c.wave)
    assert not any(work)
    assert all(d == done[0] for d in done)
    assert done[0] == list(range(len(done[0])))


# --- DPEnv ----------------------------------------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5",
            "MASTER_PORT": "29500"}


def test_flags_alone_describe_the_rank():
    env = DPEnv.resolve(rank=1, world_size=3, master_port=4000, environ={})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port,
            env.from_torchrun) == (1, 3, 1, "127.0.0.1", 4000, False)
    assert env.is_rank and env.has_store


def test_torchrun_environment_fills_what_the_flags_leave_unset():
    env = DPEnv.resolve(environ=TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port,
            env.from_torchrun) == (1, 2, 1, "10.0.0.5", 29500, True)
    env = DPEnv.resolve(master_port=7000, master_addr="127.0.0.1", environ=TORCHRUN)
    assert (env.master_addr, env.master_port, env.rank) == ("127.0.0.1", 7000, 1)


def test_rank_and_world_size_from_the_environment_need_both():
    env = DPEnv.resolve(environ={"RANK": "3"})
    assert (env.rank, env.world_size, env.is_rank) == (0, 1, False)


def test_a_lone_engine_is_not_a_rank_and_has_no_store():
    env = DPEnv.from_config(EngineConfig(), environ={})
    assert (env.is_rank, env.has_store) == (False, False)


def test_from_config_treats_defaults_as_unset_and_apply_writes_the_rank_back():
    env = DPEnv.from_config(EngineConfig(), environ=TORCHRUN)
    assert (env.rank, env.world_size, env.master_port) == (1, 2, 29500)
    cfg = env.apply(EngineConfig())
    assert (cfg.dp_rank, cfg.data_parallel_size, cfg.dp_master_addr, cfg.dp_master_port) == \
        (1, 2, "10.0.0.5", 29500)
    flags = EngineConfig(data_parallel_size=4, dp_rank=2, dp_master_port=5000)
    env = DPEnv.from_config(flags, environ=TORCHRUN)
    assert (env.rank, env.world_size, env.master_port) == (2, 4, 5000)


@pytest.mark.parametrize("kw, match", [
    ({"rank": 2, "world_size": 2}, "outside 0..1"),
    ({"rank": 0, "world_size": 0}, ">= 1"),
    ({"rank": 0, "world_size": 2, "master_port": 70000}, "not a TCP port"),
])
def test_inconsistent_values_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DPEnv.resolve(environ={}, **kw)


def test_a_non_integer_environment_variable_is_named():
    with pytest.raises(ValueError, match="RANK='x'"):
        DPEnv.resolve(environ={"RANK": "x", "WORLD_SIZE": "2"})


def test_rank_records_live_under_the_vconsole_prefix():
    assert rank_key(3) == "vconsole/rank/3"


# --- protocol -------------------------------------------------------------------------------

def test_dp_messages_round_trip():
    h = protocol.decode(protocol.encode_start_wave(7))
    assert (h["type"], protocol.parse_start_wave(h)) == ("start_wave", 7)
    h = protocol.decode(protocol.encode_regroup(2))
    assert (h["type"], protocol.parse_regroup(h)) == ("regroup", 2)
    h = protocol.decode(protocol.encode_wave("complete", 3))
    assert (h["type"], protocol.parse_wave(h)) == ("wave", ("complete", 3))


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_dp_message_numbers_must_be_non_negative_integers(bad):
    with pytest.raises(protocol.ProtocolError, match="wave must be an integer >= 0"):
        protocol.parse_start_wave({"type": "start_wave", "wave": bad})
    with pytest.raises(protocol.ProtocolError, match="generation must be an integer >= 0"):
        protocol.parse_regroup({"type": "regroup", "generation": bad})


def test_a_wave_event_must_be_start_or_complete():
    with pytest.raises(protocol.ProtocolError, match="event must be one of"):
        protocol.parse_wave({"type": "wave", "event": "done", "wave": 1})
    with pytest.raises(ValueError):
        protocol.encode_wave("done", 1)
