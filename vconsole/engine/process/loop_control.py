"""The busy loop's half of a control call or a config reload: applied between two steps.

The control thread (`vconsole.engine.process.control_server`) queues ``set_config``,
``profile_start`` and ``profile_cancel`` as a `ControlCall`; SIGHUP and the config file watcher
queue a reload. The busy loop takes them off its queue and hands them to `LoopControl`, so
a change is atomic between two steps by construction. An applied change is logged, published
(``config`` topic, the publisher's copy), recorded in the request trace and becomes the I/O
threads' `view`. Used by the busy loop's thread only, except `view`, a tuple replaced whole.

A change of ``request_trace`` opens its file before the change applies: a path that cannot be
written refuses it (a ``set_config`` as a whole, as it is all-or-nothing; a reloaded file's
other keys still apply), with the reason. Once applied, the opened file goes to the trace
book, which closes the one before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vconsole.engine.process.config_watch import apply_file, read_file
from vconsole.engine.process.request_trace import KEY as TRACE_KEY
from vconsole.engine.process.request_trace import open_trace_file, trace_file_path
from vconsole.shared.config import ConfigUpdate, apply_update
from vconsole.telemetry.request_text import KEY as TEXT_KEY
from vconsole.wire import control, protocol

if TYPE_CHECKING:
    from io import FileIO

    from vconsole.engine.process.control_server import ControlCall
    from vconsole.engine.process.profile_book import ProfileBook
    from vconsole.engine.process.request_trace import TraceBook
    from vconsole.engine.process.serving_core import ServingCore
    from vconsole.engine.publish.publisher import TelemetryPublisher
    from vconsole.shared.config import EngineConfig

log = logging.getLogger("vconsole.engine")


class LoopControl:
    """``stopping``: why the loop is leaving (None while it serves: nothing new then);
    ``on_change``: after a change was applied and published (KV events, when on); ``trace``:
    the request trace, told of every change."""

    def __init__(self, core: ServingCore, profiles: ProfileBook, publisher: TelemetryPublisher,
                 *, config_path: str | None, stopping: Callable[[], str | None],
                 on_change: Callable[[], None], trace: TraceBook | None = None) -> None:
        self.core = core
        self.profiles = profiles
        self.publisher = publisher
        self.config_path = config_path
        self._stopping = stopping
        self._on_change = on_change
        self.trace = trace
        # A request_trace change's file, opened and waiting for the change to apply.
        self._trace_opened: tuple[FileIO | None, str | None] | None = None
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
            return control.profile_reply(self.profiles.start(
                self.core, fields["steps"], nsys=bool(fields.get("nsys"))), request_id)
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
        why = self._open_trace_file(values)
        if why is not None:
            return ConfigUpdate(self.core.config, rejected={TRACE_KEY: why})
        return self.core.apply_config(values)

    def _apply_file_values(self, values: dict[str, Any]) -> ConfigUpdate:
        """A reloaded file's hot keys: request text refused here, or a trace file that cannot
        be written, is dropped (rejected, with the reason) and the rest applied, so one such
        key does not block every later reload of the file."""
        rejected: dict[str, str] = {}
        refusal = self.publisher.refuses_text(values)
        if refusal is not None:
            values = {k: v for k, v in values.items() if k != TEXT_KEY}
            rejected[TEXT_KEY] = refusal
        why = self._open_trace_file(values)
        if why is not None:
            values = {k: v for k, v in values.items() if k != TRACE_KEY}
            rejected[TRACE_KEY] = why
        update = self.core.apply_config(values) if values else ConfigUpdate(self.core.config)
        update.rejected.update(rejected)
        return update

    def _open_trace_file(self, values: dict[str, Any]) -> str | None:
        """When ``values`` would change ``request_trace``, open the new file now (kept in
        ``_trace_opened`` until `_after_change`); why it cannot be opened, else None."""
        self._trace_opened = None
        if self.trace is None or TRACE_KEY not in values:
            return None
        check = apply_update(self.core.config, values)     # pure: changes nothing
        if TRACE_KEY not in check.applied:
            return None         # unchanged, or the change is refused anyway
        path = check.applied[TRACE_KEY]
        if path is None:
            self._trace_opened = (None, None)
            return None
        path = trace_file_path(path, self.core.config)
        try:
            self._trace_opened = (open_trace_file(path), path)
        except OSError as e:
            return str(e)
        return None

    def _after_change(self, update: ConfigUpdate, source: str) -> None:
        opened, self._trace_opened = self._trace_opened, None
        if TRACE_KEY not in update.applied and opened is not None:
            if opened[0] is not None:
                opened[0].close()   # opened for a change that did not apply after all
            opened = None
        if not update.applied:
            return
        log.info("config v%d from %s: %s", self.core.config_version, source,
                 ", ".join(f"{k}={v}" for k, v in update.applied.items()))
        self.view = (self.core.config_version, self.core.config)
        if self.trace is not None:
            self.trace.config_changed(self.core.config_version, self.core.config)
            if opened is not None:
                self.trace.use_file(*opened)
        self.publisher.update_config(self.core.config)
        self.publish_config()
        self._on_change()
