"""The busy loop's half of a control call or a config reload: applied between two steps.

The control thread (`vconsole.engine.process.control_server`) queues ``set_config``,
``profile_start`` and ``profile_cancel`` as a `ControlCall`; SIGHUP and the config file watcher
queue a reload. The busy loop takes them off its queue and hands them to `LoopControl`, so
a change is atomic between two steps by construction. An applied change is logged, published
(``config`` topic, the publisher's copy) and becomes the I/O threads' `view`. Used by the busy
loop's thread only, except `view`, a tuple replaced whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vconsole.engine.client import protocol
from vconsole.engine.process.config_watch import apply_file, read_file
from vconsole.shared.config import ConfigUpdate
from vconsole.telemetry import control
from vconsole.telemetry.request_text import KEY as TEXT_KEY

if TYPE_CHECKING:
    from vconsole.engine.process.control_server import ControlCall
    from vconsole.engine.process.profile_book import ProfileBook
    from vconsole.engine.process.serving_core import ServingCore
    from vconsole.engine.publish.publisher import TelemetryPublisher
    from vconsole.shared.config import EngineConfig

log = logging.getLogger("vconsole.engine")


class LoopControl:
    """``stopping``: why the loop is leaving (None while it serves: nothing new then);
    ``on_change``: after a change was applied and published (KV events, when on)."""

    def __init__(self, core: ServingCore, profiles: ProfileBook, publisher: TelemetryPublisher,
                 *, config_path: str | None, stopping: Callable[[], str | None],
                 on_change: Callable[[], None]) -> None:
        self.core = core
        self.profiles = profiles
        self.publisher = publisher
        self.config_path = config_path
        self._stopping = stopping
        self._on_change = on_change
        self.view: tuple[int, EngineConfig] = (core.config_version, core.config)

    def apply(self, call: ControlCall) -> None:
        """A queued control call, unless the control thread gave up on it."""
        if call.op == "profile_start":
            call.run(self._profile_start)
        elif call.op == "profile_cancel":
            call.run(self._profile_cancel)
        else:
            call.run(self._set_config)

    def reload(self, reason: str) -> None:
        """Re-read the config file; a key it rejects is logged, the rest applied."""
        if not self.config_path:
            log.info("%s: no --config file to reload", reason)
            return
        try:
            values = read_file(self.config_path)
        except ValueError as e:
            log.error("config reload (%s) failed: %s", reason, e)
            return
        update = apply_file(self._apply_file_values, self.core.config, values)
        self._after_change(update, f"{self.config_path} ({reason})")
        for key, why in update.rejected.items():
            log.error("config reload (%s): %s rejected: %s", reason, key, why)
        for key in update.restart_required:
            log.warning("config reload (%s): %s changed in the file: restart_required (the "
                        "running value stays until the engine restarts)", reason, key)

    def publish_config(self) -> None:
        self.publisher.publish_config(self.core.config_version, self.core.config.to_dict())

    def _profile_start(self, fields: dict[str, Any], request_id: int | None) -> dict[str, Any]:
        if self._stopping() is not None:
            return control.error_reply(protocol.SHUTTING_DOWN, request_id)
        try:
            return control.profile_reply(self.profiles.start(self.core, fields["steps"]),
                                         request_id)
        except ValueError as e:
            return control.error_reply(str(e), request_id)

    def _profile_cancel(self, fields: dict[str, Any], request_id: int | None) -> dict[str, Any]:
        try:
            return control.profile_reply(self.profiles.cancel(fields["profile"]), request_id)
        except ValueError as e:
            return control.error_reply(str(e), request_id)

    def _set_config(self, values: dict[str, Any], request_id: int | None) -> dict[str, Any]:
        if self._stopping() is not None:
            return control.error_reply(protocol.SHUTTING_DOWN, request_id)
        update = self._apply(values)
        self._after_change(update, "set_config")
        return control.config_reply(self.core.config_version, self.core.config.to_dict(),
                                    update, request_id=request_id)

    def _apply(self, values: dict[str, Any]) -> ConfigUpdate:
        """The core's `apply_config` for a ``set_config``, but request text is refused (the
        whole change with it, as a set is all-or-nothing) where the telemetry socket may not
        carry it."""
        refusal = self.publisher.refuses_text(values)
        if refusal is not None:
            return ConfigUpdate(self.core.config, rejected={TEXT_KEY: refusal})
        return self.core.apply_config(values)

    def _apply_file_values(self, values: dict[str, Any]) -> ConfigUpdate:
        """A reloaded file's hot keys: request text refused here is dropped (rejected, with
        the reason) and the rest applied, so one key the socket may not carry does not block
        every later reload of the file."""
        refusal = self.publisher.refuses_text(values)
        if refusal is None:
            return self.core.apply_config(values)
        rest = {k: v for k, v in values.items() if k != TEXT_KEY}
        update = self.core.apply_config(rest) if rest else ConfigUpdate(self.core.config)
        update.rejected[TEXT_KEY] = refusal
        return update

    def _after_change(self, update: ConfigUpdate, source: str) -> None:
        if not update.applied:
            return
        log.info("config v%d from %s: %s", self.core.config_version, source,
                 ", ".join(f"{k}={v}" for k, v in update.applied.items()))
        self.view = (self.core.config_version, self.core.config)
        self.publisher.update_config(self.core.config)
        self.publish_config()
        self._on_change()
