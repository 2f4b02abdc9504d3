"""Steering, the console's steering model, without Textual: read-only reasons, each action's
plan (refused, nothing to do, or the confirmation it needs), ``begin`` (sent, or the `Ask` the UI
answers), the send and the reply, with the fake control and an inline host. (The app's
confirmation box and workers: test_console_app.py.)"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from support.console_testing import FakeControl, InlineHost
from vconsole.console.advisor import Advice
from vconsole.console.changes import ERROR, INVALID, UNCHANGED
from vconsole.console.control_link import Control
from vconsole.console.plans import ROUTINE, Confirmation, Notice, Outcome
from vconsole.console.profile_run import ProfileRun
from vconsole.console.sources.vllm_actions import ACTIONS, ActionError
from vconsole.console.state import ConsoleState
from vconsole.console.steering import NO_KEY, Steering
from vconsole.wire.control_client import NotAuthorised


def steering(control: Any = None, **kw: Any) -> Steering:
    st = Steering(ConsoleState(), control or FakeControl(), **kw)
    assert st.fetch_config(threading.Event())       # the engine's config, as the app fetches it
    return st


def test_read_only_reasons_in_their_order(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/control"
    state = ConsoleState()
    assert Steering.connect(state, control_endpoint=ep, readonly=True).readonly_reason \
        == "--readonly"
    assert Steering.connect(state, control_endpoint=ep, source_readonly="replay").readonly_reason == "replay"
    assert Steering.connect(state, control_endpoint=None).readonly_reason \
        == "no control endpoint"
    no_key = Steering.connect(state, control_endpoint=ep,
                              control_key_file=tmp_path / "missing.key")
    assert no_key.readonly_reason == f"{NO_KEY}: {tmp_path / 'missing.key'}"
    assert not no_key.take_written_key()               # still no file: stays read-only
    (tmp_path / "missing.key").write_text("ab" * 32 + "\n")
    (tmp_path / "missing.key").chmod(0o600)
    assert no_key.take_written_key() and no_key.leave_readonly(NO_KEY)
    assert not no_key.readonly
    writable = Steering.connect(state, control_endpoint=ep, control_key="ab" * 32)
    assert not writable.readonly and writable.control is not None


def test_a_bad_or_equal_value_is_recorded_but_never_sent() -> None:
    ctl = FakeControl()
    st = steering(ctl)
    bad = st.plan_change("max_num_seqs", "lots", None)
    assert bad.refused and "integer" in bad.refused
    same = st.plan_change("max_num_seqs", "32", None)
    assert same.refused is None and same.unchanged
    assert [st.replies["max_num_seqs"].status] == [UNCHANGED]
    assert st.change_log == [] and not [c for c in ctl.calls if c[0] == "set_config"]
    assert st.plan_change("no_such_key", "1", None).refused == "unknown key 'no_such_key'"
    st.plan_change("max_num_seqs", "0", None)
    assert st.replies["max_num_seqs"].status == INVALID


def test_a_risky_change_names_its_consequence_and_the_send_path_applies_it() -> None:
    ctl = FakeControl()
    st = steering(ctl)
    plan = st.plan_change("max_num_seqs", "4", None)
    assert plan.refused is None and plan.risk and "Cuts max_num_seqs from 32 to 4" in plan.risk
    rec = st.start_change("max_num_seqs", plan.old, plan.value)
    assert st.change_log == [rec] and rec.status == "pending"
    assert st.round_trip([rec])
    assert rec.status == "applied" and st.state.config.values["max_num_seqs"] == 4
    assert ctl.calls[-1] == ("set_config", {"max_num_seqs": 4})


class RefusingControl(FakeControl):
    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        raise NotAuthorised("the engine refused the control key")


def test_a_refused_key_fails_the_records_and_makes_the_console_read_only() -> None:
    st = steering(RefusingControl(), control_key_file=Path("/run/k"))
    rec = st.start_change("max_num_seqs", 32, 16)
    assert st.round_trip([rec]) is False
    assert rec.status == ERROR and "refused" in rec.reason
    st.key_refused()
    assert st.readonly and st.readonly_reason == "engine refused the control key: /run/k"
    assert st.plan_change("max_num_seqs", "8", None).refused.startswith("read-only console")


# --- plan → confirm-needed → send → reply, with the fake control and an inline host ----------


def hosted(control: Any = None, **kw: Any) -> tuple[Steering, InlineHost]:
    host = InlineHost()
    st = steering(control, host=host, **kw)
    return st, host


def test_the_control_protocol_is_the_links_six_calls() -> None:
    assert isinstance(FakeControl(), Control)

    class NoCancel:
        def key_status(self) -> None: ...
        def get_config(self) -> dict[str, Any]: ...
        def set_config(self, values: dict[str, Any]) -> dict[str, Any]: ...
        def profile_start(self, steps: int) -> dict[str, Any]: ...
        def profile_status(self, profile_id: str) -> dict[str, Any]: ...

    assert not isinstance(NoCancel(), Control)


def test_a_change_plan_says_whether_to_confirm_and_the_reply_comes_back_as_an_update() -> None:
    ctl = FakeControl()
    st, host = hosted(ctl)
    safe = st.plan_change("max_num_seqs", "48", None)
    assert safe.confirmation is None and safe.nothing_to_do is None
    same = st.plan_change("max_num_seqs", "32", None)
    assert same.nothing_to_do == Notice("Config", "max_num_seqs is already 32")
    risky = st.plan_change("max_num_seqs", "4", None)
    ask = risky.confirmation
    assert ask is not None and ask.title == "Change max_num_seqs: 32 → 4?"
    assert ask.text == risky.risk and ask.label == "Apply change"
    assert risky.declined == Notice("Config", "max_num_seqs left at 32")
    assert host.updates == []                           # planning sends nothing

    begun = st.begin(risky)                             # asks: the UI shows the box
    assert begun.ask is not None and begun.ask.confirmation == ask and not begun.sent
    assert begun.ask.forecast is None                   # no trace channel: no what-if
    assert st.answer(begun.ask, False) == Outcome(notice=risky.declined)
    assert host.updates == [] and st.change_log == []   # a no sends nothing
    before = st.generation
    assert st.answer(begun.ask, True) == Outcome(sent=True)   # the operator confirmed
    (update,) = host.updates
    rec = st.replies["max_num_seqs"]
    assert host.groups == ["config-set"] and st.change_log == [rec]
    assert rec.status == "applied" and update.record is rec and not update.readonly_changed
    assert update.notice == Notice("Engine reply", f"max_num_seqs 32 → 4: {rec.summary()}")
    assert st.generation == before + 2                  # the pending record, then the answer
    assert ctl.calls[-1] == ("set_config", {"max_num_seqs": 4})


def test_a_restart_only_answer_is_a_warning_and_a_timeout_an_error() -> None:
    ctl = FakeControl()
    st, host = hosted(ctl)
    st.begin(st.plan_change("block_size", "32", None), confirmed=True)
    assert host.updates[-1].notice.severity == "warning"
    ctl.down = True
    assert st.begin(st.plan_change("policy", "hybrid", None)).sent   # routine: no box

    assert host.updates[-1].notice.severity == "error"
    assert st.replies["policy"].status == "no answer"


def test_a_refused_key_on_send_comes_back_as_read_only() -> None:
    st, host = hosted(RefusingControl(), control_key_file=Path("/run/k"))
    assert st.begin(st.plan_change("max_num_seqs", "16", None), confirmed=True).sent
    (update,) = host.updates
    assert update.readonly_changed and st.readonly
    assert update.notice is not None and update.notice.severity == "error"


def advice(change: dict[str, Any], current: dict[str, Any], hot: bool = True) -> Advice:
    return Advice("sched_share", "scheduling takes a large share", {}, change, hot, "why",
                  current)


def test_advice_is_always_confirmed_sent_at_once_and_its_outcome_noted() -> None:
    ctl = FakeControl()
    st, host = hosted(ctl)
    a = advice({"policy": "hybrid", "max_num_seqs": 48}, {"policy": "fcfs", "max_num_seqs": 32})
    plan = st.plan_advice(a, None)
    assert plan.refused is None and plan.nothing_to_do is None
    assert plan.changes == {"policy": ("fcfs", "hybrid"), "max_num_seqs": (32, 48)}
    ask = plan.confirmation
    assert ask.title == f"Apply advice: {a.change_text()}?" and ask.label == "Apply advice"
    assert "Applied between two steps" in ask.text and "Advice screen" in ask.text
    assert plan.declined == Notice("Advice", f"advice not applied: {a.change_text()}")

    assert st.begin(plan).ask.confirmation == ask       # always asks
    st.begin(plan, confirmed=True)
    (out,) = st.advice_outcomes
    assert out.ok and ctl.calls[-1] == ("set_config", {"policy": "hybrid", "max_num_seqs": 48})
    assert host.updates[-1].notice == Notice("Advice", f"{a.change_text()}: {out.summary}")
    assert st.state.alerts[-1].name == "advice sched_share"   # the Alerts panel shows it
    assert st.plan_advice(a, None).nothing_to_do is not None   # now in force
    assert "restart-only" in st.plan_advice(advice({"block_size": 32}, {}, hot=False),
                                            None).refused


def test_a_profile_is_confirmed_followed_to_its_end_and_one_at_a_time() -> None:
    ctl = FakeControl()
    ctl.profile_steps_per_poll = 20
    st, host = hosted(ctl)
    plan = st.plan_profile(20)
    assert plan.refused is None and plan.confirmation.title == \
        "Profile the engine's next 20 steps?"
    assert "slower" in plan.confirmation.text and plan.confirmation.label == "Start profile"
    assert plan.declined == Notice("Profile", "no profile started")
    st.begin(plan, confirmed=True)                      # the inline host follows it to its end
    run = st.profile_run
    assert run is not None and run.state == "done" and run.result is not None
    assert host.groups == ["profile"] and len(host.updates) >= 2   # started, then done

    run.state = "running"                               # as if it still ran
    assert st.plan_profile(20).refused == "p1 is running: c cancels it"


def test_cancel_asks_the_engine_and_a_failure_is_a_notice() -> None:
    ctl = FakeControl()
    st, host = hosted(ctl)
    started = ctl.profile_start(20)
    st.profile_run = ProfileRun(20, state="running", id=started["id"])
    st.cancel_profile()
    assert ctl.calls[-1] == ("profile_cancel", {"profile": "p1"})
    assert host.groups == ["profile-cancel"] and host.updates == []
    ctl.down = True
    st.cancel_profile()
    assert host.updates[-1].notice == Notice(
        "Profile", "cancelling p1 failed: no reply from the engine's control socket (fake, "
        "down)", "error")
    st.make_readonly("--readonly")
    st.cancel_profile()                                 # read-only: nothing is asked
    assert len(host.groups) == 2 and st.plan_profile(20).refused == \
        "read-only console (--readonly)"


class VllmLike:
    actions = ACTIONS

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def describe(self) -> str:
        return "http://vllm:8000/metrics"

    def run_action(self, key: str) -> str:
        if self.fail:
            raise ActionError(f"{key}: HTTP 404")
        return f"{key}: done"


def test_a_vllm_action_is_confirmed_then_its_answer_is_a_notice() -> None:
    st, host = hosted()
    plan = st.plan_action(VllmLike(), "reset_prefix_cache")
    assert plan.confirmation == Confirmation("Reset the prefix cache?",
                                             plan.action.consequence, "Reset the prefix cache")
    ask = st.begin(plan).ask
    assert ask is not None and st.answer(ask, False) == Outcome()   # a no says nothing
    assert host.updates == []
    st.answer(ask, True)
    assert host.updates[-1].notice == Notice("vLLM", "reset_prefix_cache: done")
    st.begin(st.plan_action(VllmLike(fail=True), "reset_prefix_cache"), confirmed=True)
    assert host.updates[-1].notice == Notice("vLLM", "reset_prefix_cache: HTTP 404", "error")
    assert st.plan_action(VllmLike(), "fly").refused == \
        "http://vllm:8000/metrics offers no action 'fly'"
    st.make_readonly("--readonly")
    assert st.plan_action(VllmLike(), "reset_prefix_cache").refused == \
        "read-only console: no actions"


class TracingFake(FakeControl):
    """A control channel with the engine's trace: the console has a what-if."""

    def get_trace(self, window_s: float | None = None) -> str:
        raise AssertionError("begin never fetches: the box's forecast does, in its worker")


def test_a_routine_change_the_whatif_models_asks_with_its_forecast_and_one_it_does_not_sends(
        ) -> None:
    st, host = hosted(TracingFake())
    assert st.whatif.available
    plan = st.plan_change("max_num_seqs", "48", None)
    assert plan.confirmation is None                    # routine on its own
    begun = st.begin(plan)
    ask = begun.ask
    assert ask is not None and not begun.sent and host.updates == []
    assert ask.confirmation == Confirmation("Change max_num_seqs: 32 → 48?", ROUTINE)
    assert ask.forecast is not None and "predicting" in ask.forecast.first
    assert ask.forecast.work is not None                # computed while the operator reads
    unmodelled = st.plan_change("log_stats_interval_s", "2", None)
    assert st.begin(unmodelled).sent                    # no effect to read first: sent at once
