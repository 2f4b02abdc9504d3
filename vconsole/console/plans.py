"""What the console means to do to the engine, decided before anything is sent: the plans.

Every action that changes an engine goes the same way: `vconsole.console.steering.Steering`
plans it, then ``Steering.begin(plan)`` sends it or returns the `Ask` the operator must answer
(the app shows the box and hands the answer back to ``Steering.answer``). A plan is either
``refused`` (with the reason: nothing is sent, the operator is told why), has nothing to do
(``nothing_to_do``: a `Notice` saying so), or is sent — after the operator confirmed its
``confirmation`` when it has one. ``declined`` is what the console says when the operator says
no. Plans are plain data: no I/O, no Textual. Each kind sends itself (``send``) through the
`Sender` it is given (Steering): a new kind of action is a plan here and a send method there.

``proposed`` is the config change a plan would make (key → new value): Steering asks the
what-if (`vconsole.console.predictions`) for its predicted effect, which the box shows. A
one-key change the what-if can predict is confirmed even when it is routine
(``confirmation_for(modelled=True)``, `ChangePlan.ask`), so the operator sees its effect
before it is sent.

- `ChangePlan`: one config key (the Config screen's editor, the palette's "Edit config").
- `AdvicePlan`: an advisor's hot suggestion, all its keys in one ``set_config``.
- `EditsPlan`: the What-if screen's edits of hot keys, all in one ``set_config``.
- `ProfilePlan`: profile the engine's next N steps (`vconsole.console.profile_run`).
- `ActionPlan`: one of a vLLM server's action routes (`vconsole.console.sources.vllm_actions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from vconsole.console.changes import (
    INVALID,
    UNCHANGED,
    ChangeRecord,
    consequence,
    show_value,
    validate,
)
from vconsole.console.profile_run import consequence as profile_consequence

if TYPE_CHECKING:
    from vconsole.console.forecast import Forecast
    from vconsole.console.sources.source import SourceAction
    from vconsole.console.state import ConfigView, EngineState

ROUTINE = "Applied between two steps; nothing is preempted."

Severity = Literal["information", "warning", "error"]   # Textual's notification severities
INFO: Severity = "information"
WARNING: Severity = "warning"
ERROR: Severity = "error"


@dataclass(frozen=True)
class Notice:
    """A line for the operator (the app shows it as a notification)."""

    title: str
    text: str
    severity: Severity = INFO


@dataclass(frozen=True)
class Confirmation:
    """The box the operator must confirm before a plan is sent."""

    title: str
    text: str
    label: str = "Apply change"


class Sender(Protocol):
    """What plans send themselves through (`vconsole.console.steering.Steering`): each call
    sends at once and the reply comes back later, as an ``Update`` through Steering's host."""

    def send_change(self, key: str, old: Any, value: Any) -> object: ...

    def send_advice(self, advice: Any, changes: dict[str, tuple[Any, Any]]) -> object: ...

    def send_edits(self, changes: dict[str, tuple[Any, Any]]) -> object: ...

    def start_profile(self, steps: int) -> object: ...

    def run_action(self, run: Callable[[], str]) -> None: ...


class Plan(Protocol):
    """What every kind of plan answers (see the module docstring)."""

    @property
    def refused(self) -> str | None: ...

    @property
    def nothing_to_do(self) -> Notice | None: ...

    @property
    def declined(self) -> Notice | None: ...

    @property
    def proposed(self) -> dict[str, Any] | None:
        """The config change it would make (key → new value); None: it changes no config."""

    def confirmation_for(self, modelled: bool) -> Confirmation | None:
        """The box the operator must confirm, if any; ``modelled``: the what-if will show the
        change's predicted effect in it."""

    def send(self, via: Sender) -> None:
        """Send it (refused: never called; asks: after the operator confirmed)."""


@dataclass(frozen=True)
class Ask:
    """A plan waiting for the operator: the box to show (``forecast``: lines the box computes
    while the operator reads it), and the plan to send on yes (`Steering.answer`)."""

    plan: Plan
    confirmation: Confirmation
    forecast: Forecast | None = None


@dataclass(frozen=True)
class Outcome:
    """What became of a plan `Steering.begin` or `Steering.answer` was given, for the UI:
    ``refused`` (nothing sent; the caller shows why where it asked), a ``notice`` to show
    (nothing to do, declined), an ``ask`` to show as a box, or ``sent``."""

    refused: str | None = None
    notice: Notice | None = None
    ask: Ask | None = None
    sent: bool = False


@dataclass
class ChangePlan:
    """One config key: ``refused`` (not sent, with the reason), nothing to do
    (``value == old``), or send ``value`` after confirming ``risk`` when there is one (or when
    ``ask``: the box then carries the change's predicted effect). ``noted``: the record of a
    value refused here or equal to the current one (Steering keeps it as the key's last
    answer; it was never sent). ``hot``: the engine applies the key live."""

    key: str
    old: Any = None
    value: Any = None
    refused: str | None = None
    risk: str | None = None
    noted: ChangeRecord | None = None
    hot: bool = True
    ask: bool = False

    @property
    def unchanged(self) -> bool:
        return self.refused is None and self.value == self.old

    @property
    def nothing_to_do(self) -> Notice | None:
        return Notice("Config", f"{self.key} is already {show_value(self.value)}") \
            if self.unchanged else None

    @property
    def confirmation(self) -> Confirmation | None:
        if self.risk is None and not self.ask:
            return None
        return Confirmation(f"Change {self.key}: {show_value(self.old)} → "
                            f"{show_value(self.value)}?", self.risk or ROUTINE)

    @property
    def declined(self) -> Notice | None:
        return Notice("Config", f"{self.key} left at {show_value(self.old)}")

    @property
    def proposed(self) -> dict[str, Any] | None:
        return {self.key: self.value}

    def confirmation_for(self, modelled: bool) -> Confirmation | None:
        """A routine change of a hot key asks too when its effect is modelled (worth reading
        before it is sent)."""
        if self.confirmation is None and modelled and self.hot:
            self.ask = True
        return self.confirmation

    def send(self, via: Sender) -> None:
        via.send_change(self.key, self.old, self.value)


class _AlwaysConfirmed:
    """What a plan that changes several keys and always asks first says of itself: the new
    values it proposes (for the what-if), and its one confirmation whatever the model says."""

    changes: dict[str, tuple[Any, Any]]

    @property
    def confirmation(self) -> Confirmation:
        raise NotImplementedError

    @property
    def proposed(self) -> dict[str, Any] | None:
        return {k: new for k, (_, new) in self.changes.items()}

    def confirmation_for(self, modelled: bool) -> Confirmation | None:
        return self.confirmation


@dataclass
class AdvicePlan(_AlwaysConfirmed):
    """An advisor's hot suggestion (`vconsole.console.advisor.Advice`): ``refused``, or
    ``changes`` (key → (old, new); empty: already in force) with the ``risks`` the
    confirmation names. Always confirmed: the box names each change and what it does to the
    running load."""

    advice: Any = None
    refused: str | None = None
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    risks: list[str] = field(default_factory=list)

    @property
    def nothing_to_do(self) -> Notice | None:
        return None if self.changes else Notice("Advice", "already in force: "
                                                f"{self.advice.change_text()}")

    @property
    def confirmation(self) -> Confirmation:
        text = "\n".join(self.risks) if self.risks else ROUTINE
        text += f"\nSuggested by the advisor ({self.advice.title}): its reasons are on the " \
                "Advice screen."
        return Confirmation(f"Apply advice: {self.advice.change_text()}?", text, "Apply advice")

    @property
    def declined(self) -> Notice | None:
        return Notice("Advice", f"advice not applied: {self.advice.change_text()}")

    def send(self, via: Sender) -> None:
        via.send_advice(self.advice, self.changes)


@dataclass
class EditsPlan(_AlwaysConfirmed):
    """Several hot keys at once (the What-if screen's edits): ``refused``, or ``changes``
    (key → (old, new); empty: already in force) in one all-or-nothing ``set_config``. Always
    confirmed, with the ``risks`` of each change."""

    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    refused: str | None = None
    risks: list[str] = field(default_factory=list)

    def change_text(self) -> str:
        return ", ".join(f"{k} {show_value(old)} → {show_value(new)}"
                         for k, (old, new) in self.changes.items())

    @property
    def nothing_to_do(self) -> Notice | None:
        return None if self.changes else Notice("What-if", "the edits are already in force")

    @property
    def confirmation(self) -> Confirmation:
        text = "\n".join(self.risks) if self.risks else ROUTINE
        return Confirmation(f"Apply {self.change_text()}?", text, "Apply changes")

    @property
    def declined(self) -> Notice | None:
        return Notice("What-if", f"not applied: {self.change_text()}")

    def send(self, via: Sender) -> None:
        via.send_edits(self.changes)


@dataclass
class ProfilePlan:
    """Profile the engine's next ``steps`` steps: always confirmed (every profiled step runs
    slower)."""

    steps: int
    refused: str | None = None
    nothing_to_do: Notice | None = None

    @property
    def confirmation(self) -> Confirmation:
        return Confirmation(f"Profile the engine's next {self.steps} steps?",
                            profile_consequence(self.steps), "Start profile")

    @property
    def declined(self) -> Notice | None:
        return Notice("Profile", "no profile started")

    proposed = None     # a profile changes no config

    def confirmation_for(self, modelled: bool) -> Confirmation | None:
        return self.confirmation

    def send(self, via: Sender) -> None:
        via.start_profile(self.steps)


@dataclass
class ActionPlan:
    """Ask a source's server to do one of its actions (``run``, blocking; a vLLM server's
    routes): always confirmed; a no says nothing."""

    action: SourceAction | None = None
    run: Callable[[], str] | None = None
    refused: str | None = None
    nothing_to_do: Notice | None = None
    declined: Notice | None = None
    proposed = None     # an action changes no config

    @property
    def confirmation(self) -> Confirmation | None:
        a = self.action
        return None if a is None else Confirmation(f"{a.title}?", a.consequence, a.title)

    def confirmation_for(self, modelled: bool) -> Confirmation | None:
        return self.confirmation

    def send(self, via: Sender) -> None:
        assert self.run is not None, "an action plan that was not refused has its run"
        via.run_action(self.run)


if TYPE_CHECKING:   # the type checker verifies every kind is a whole Plan
    _plans: tuple[type[Plan], ...] = (ChangePlan, AdvicePlan, EditsPlan, ProfilePlan,
                                      ActionPlan)


def plan_change(cfg: ConfigView | None, key: str, text: str,
                engine: EngineState | None) -> ChangePlan:
    """Validate ``text`` for ``key`` against the engine's known config and name the risk."""
    if cfg is None:
        return ChangePlan(key, refused="the engine's config is not known yet")
    row = cfg.row(key)
    if row is None:
        return ChangePlan(key, refused=f"unknown key {key!r}")
    old = cfg.values.get(key)
    value, reason = validate(key, text)
    if reason is not None:
        return ChangePlan(key, old, refused=reason, noted=ChangeRecord(
            key, old, text, status=INVALID, reason=reason))
    if value == old:
        return ChangePlan(key, old, value, noted=ChangeRecord(
            key, old, value, status=UNCHANGED, reason="same as the current value"))
    sc, kvp = latest(engine)
    hot = bool(row.get("hot", True))
    risk = consequence(key, old, value, num_running=sc.get("num_running"),
                       num_cached=kvp.get("num_cached"), hot=hot)
    return ChangePlan(key, old, value, risk=risk, hot=hot)


def plan_edits(cfg: ConfigView | None, values: dict[str, str],
               engine: EngineState | None) -> EditsPlan:
    """``values`` (key → text) as changes to the current config, with the risks the
    confirmation names. Restart-only keys are refused: the engine would change nothing."""
    if cfg is None:
        return EditsPlan(refused="the engine's config is not known yet")
    plan = EditsPlan()
    for key, text in values.items():
        row = cfg.row(key)
        if row is None:
            return EditsPlan(refused=f"unknown key {key!r}")
        if not row.get("hot", True):
            return EditsPlan(refused=f"{key} is restart-only: restart the engine with --set "
                                     f"{key}={text}")
        value, reason = validate(key, text)
        if reason is not None:
            return EditsPlan(refused=f"{key}: {reason}")
        if value != cfg.values.get(key):
            plan.changes[key] = (cfg.values.get(key), value)
    plan.risks = risks_of(plan.changes, engine)
    return plan


def plan_advice(cfg: ConfigView | None, advice: Any, engine: EngineState | None, *,
                steered: bool) -> AdvicePlan:
    """A hot suggestion as changes to the current config, with the risks the confirmation
    names. ``steered``: the advice is for the engine the control channel steers."""
    if not advice.hot:
        return AdvicePlan(advice, "restart-only: the engine would answer 'restart required'")
    if cfg is None:
        return AdvicePlan(advice, "the engine's config is not known yet")
    if not steered:
        return AdvicePlan(advice, "advice for another engine: the control channel steers the "
                                  "first one")
    plan = AdvicePlan(advice)
    for key, new in advice.change.items():
        value, reason = validate(key, show_value(new))
        if reason is not None:
            return AdvicePlan(advice, f"{key}: {reason}")
        if value != cfg.values.get(key):
            plan.changes[key] = (cfg.values.get(key), value)
    plan.risks = risks_of(plan.changes, engine)
    return plan


def risks_of(changes: dict[str, tuple[Any, Any]], engine: EngineState | None) -> list[Any]:
    """What the confirmation names for these (old, new) changes on the engine as it is now."""
    sc, kvp = latest(engine)
    return [r for k, (old, new) in changes.items()
            if (r := consequence(k, old, new, num_running=sc.get("num_running"),
                                 num_cached=kvp.get("num_cached"))) is not None]


def latest(engine: EngineState | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine's latest ``sched`` and ``kv`` bodies (empty when unknown)."""
    if engine is None:
        return {}, {}
    return engine.latest.get("sched", {}), engine.latest.get("kv", {})
