"""Steering, the console's steering model, without Textual: read-only reasons, a change's plan,
the one send path. (The app's confirmation and workers: test_console_app.py.)"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from support.console_testing import FakeControl
from vconsole.console.changes import ERROR, INVALID, UNCHANGED
from vconsole.console.state import ConsoleState
from vconsole.console.steering import NO_KEY, Steering
from vconsole.telemetry.control import NotAuthorised


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
    assert st.history == [] and not [c for c in ctl.calls if c[0] == "set_config"]
    assert st.plan_change("no_such_key", "1", None).refused == "unknown key 'no_such_key'"
    st.plan_change("max_num_seqs", "0", None)
    assert st.replies["max_num_seqs"].status == INVALID


def test_a_risky_change_names_its_consequence_and_the_send_path_applies_it() -> None:
    ctl = FakeControl()
    st = steering(ctl)
    plan = st.plan_change("max_num_seqs", "4", None)
    assert plan.refused is None and plan.risk and "Cuts max_num_seqs from 32 to 4" in plan.risk
    rec = st.start_change("max_num_seqs", plan.old, plan.value)
    assert st.history == [rec] and rec.status == "pending"
    assert st.round_trip([rec])
    assert rec.status == "applied" and st.state.config.values["max_num_seqs"] == 4
    assert ctl.calls[-1] == ("set_config", {"max_num_seqs": 4})


class RefusingControl(FakeControl):
    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        raise NotAuthorised("the engine refused the control key")


def test_a_refused_key_fails_the_records_and_makes_the_console_read_only() -> None:
    st = steering(RefusingControl(), control_key_path=Path("/run/k"))
    rec = st.start_change("max_num_seqs", 32, 16)
    assert st.round_trip([rec]) is False
    assert rec.status == ERROR and "refused" in rec.reason
    st.key_refused()
    assert st.readonly and st.readonly_reason == "engine refused the control key: /run/k"
    assert st.plan_change("max_num_seqs", "8", None).refused.startswith("read-only console")
