"""ControlServer: the engine's side of the control protocol (`vconsole.wire.control`).

It owns the control ROUTER (bound by `EngineCoreProc` with the other sockets, so a busy port
fails fast) and the thread ``engine-control``, which from `ControlServer.start` on is the only one
to touch that socket and closes it when it stops. It also owns the control key
(`vconsole.security.engine_key`): made and written to its 0600 file (with its owner
record) when the server is made, checked against every ``set_config``, the file removed when the
thread stops. The key is checked also when the socket is CURVE (`curve_server`): CURVE admits
every authorised client, including load generators and dashboards, while only holders of this
start's key may change the engine.

- ``get_config`` is answered at once from ``config_view()``, the config the busy loop last
  published; this thread never touches the core.
- ``set_config`` is checked against the key here, then handed to the busy loop as a `ControlCall`
  (``submit``). The busy loop applies it between two steps (`ControlCall.run`, from
  ``EngineCoreProc._apply_control``: that half is the seam) and this thread sends the reply once
  it was applied or refused. A call the busy loop has not reached within `CONTROL_WAIT_S` is
  cancelled and answered with an error.
- ``profile_start`` and ``profile_cancel`` take the same path as ``set_config`` (key, then a
  `ControlCall` with its ``op``: the busy loop owns the profiler, `vconsole.engine.process.profile_book`);
  ``profile_status`` is answered at once from ``profile_view(id)``, like ``get_config``.
- ``get_trace`` is answered here from ``trace_view(window_s)``, the request trace's lines
  (`vconsole.engine.process.request_trace`): serialized on this thread, never the busy loop.

Invariants:

- A ``set_config`` is applied by the busy loop, between two steps, never from this thread, so a
  config change is atomic with respect to steps.
- An unauthorised ``set_config`` (no key, the wrong key) changes nothing: it is refused here and
  never queued. Neither is one that arrives once ``stop`` is set.
- Every well-formed request gets exactly one reply: the config, a refusal, or the timeout error.
  A timed-out call is cancelled under its lock, so it is either applied (and that reply sent) or
  never applied. A request whose body is malformed is answered ``ok: false``
  (`vconsole.wire.control.handle_frames`); only frames with no body at all are logged and
  dropped (there is nothing to answer).
- The thread stops once ``stop`` is set (the engine's I/O stop, set at shutdown) and it has
  answered the call it was waiting on; until then the busy loop keeps draining its input queue so
  that call is applied or refused (``EngineCoreProc._shutdown``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vconsole.security import engine_key
from vconsole.security.control_key import control_key_file as key_file_for
from vconsole.wire import control

if TYPE_CHECKING:
    import zmq

    from vconsole.shared.config import EngineConfig

log = logging.getLogger("vconsole.engine")

CONTROL_WAIT_S = 30.0     # a set_config not applied within this is answered with an error

Reply = dict[str, Any]


@dataclass
class ControlCall:
    """A set_config in flight between the control thread and the busy loop. ``lock`` makes
    "cancelled by a timed-out waiter" and "applied by the busy loop" mutually exclusive."""

    values: dict[str, Any]
    request_id: int | None
    op: str = "set_config"          # or profile_start / profile_cancel (values: the op's fields)
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    reply: Reply | None = None

    def resolve(self, reply: Reply) -> None:
        self.reply = reply
        self.done.set()

    def run(self, apply: Callable[[dict[str, Any], int | None], Reply]) -> None:
        """Busy loop, between two steps: ``apply(values, request_id)`` applies the change and
        returns the reply, unless the waiter already gave up (then nothing is applied)."""
        with self.lock:
            if self.cancelled:
                return
            self.resolve(apply(self.values, self.request_id))


class ControlServer:
    """The control thread and the control key; see the module docstring.

    ``sock``: the bound control ROUTER (closed by the thread once started; before `start`, by
    whoever made it). ``endpoint``: the endpoint it bound, which names the key file unless
    ``key_file`` does. ``config_view()``: the busy loop's last published (version, config).
    ``submit(call)``: hands a `ControlCall` to the busy loop. ``stop``: set once, at shutdown.
    ``engine_id`` goes into the key's owner record. ``profile_view(id)`` / ``trace_view(window_s)``
    answer ``profile_status`` / ``get_trace`` (from this thread). Raises OSError when the key file cannot be
    written, `engine_key.KeyFileHeld` when a running engine holds it."""

    def __init__(self, sock: zmq.Socket, endpoint: str, *,
                 key_file: str | os.PathLike[str] | None,
                 config_view: Callable[[], tuple[int, EngineConfig]],
                 submit: Callable[[ControlCall], None], stop: threading.Event,
                 poll_ms: int = 200, engine_id: str = "",
                 profile_view: Callable[[str], dict[str, Any] | None] | None = None,
                 trace_view: Callable[[float | None], str] | None = None) -> None:
        self._profile_view = profile_view
        self._trace_view = trace_view
        self._sock = sock
        self._config_view = config_view
        self._submit = submit
        self._stop = stop
        self._poll_ms = poll_ms
        self._key = engine_key.new_key()
        self.key_file = key_file_for(endpoint, key_file)
        try:
            engine_key.claim_key_file(self.key_file, self._key, engine_id=engine_id,
                                            endpoint=endpoint)
        except engine_key.KeyFileHeld:
            raise
        except OSError as e:
            raise OSError(f"cannot write the control key file {self.key_file}: {e}") from None
        log.info("control key: %s (mode 0600; clients need it to change the config)",
                 self.key_file)
        self._thread = threading.Thread(target=self._run, name="engine-control", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def key(self) -> str:
        """This server's control key: for a channel that authenticated its peer (a CURVE rank's
        ``ready`` to its front end, `vconsole.engine.process.core_proc`), never a plain one."""
        return self._key

    def remove_key_file(self) -> None:
        """Remove the key file if it still holds this server's key. The thread does this when it
        stops; call it directly only when the server is never started."""
        engine_key.remove_key_file(self.key_file, self._key)

    # --- control thread ------------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(self._poll_ms):
                    continue
                frames = sock.recv_multipart()
                try:
                    reply = control.handle_frames(frames, self._on_request)
                except control.ControlError as e:
                    log.warning("control: dropped a malformed message: %s", e)
                    continue
                sock.send_multipart(reply)
        finally:
            sock.close()
            self.remove_key_file()

    def _on_request(self, req: dict[str, Any]) -> Reply:
        rid = req.get("id")
        if req["op"] == "get_config":
            version, cfg = self._config_view()
            return control.config_reply(version, cfg.to_dict(), request_id=rid)
        if req["op"] == "profile_status":
            status = self._profile_view(req["profile"]) if self._profile_view else None
            if status is None:
                return control.error_reply(f"no profile {req['profile']!r}", rid)
            return control.profile_reply(status, rid)
        if req["op"] == "get_trace":
            if self._trace_view is None:
                return control.error_reply("this engine keeps no request trace", rid)
            try:
                return control.trace_reply(self._trace_view(req.get("window_s")), rid)
            except Exception as e:      # the control thread keeps answering
                log.exception("control: get_trace failed")
                return control.error_reply(f"the request trace could not be made: {e}", rid)
        if not engine_key.key_matches(req.get("key"), self._key):
            log.warning("control: refused a %s without the control key", req["op"])
            return control.error_reply(engine_key.not_authorised(self.key_file), rid)
        if self._stop.is_set():
            return control.error_reply("engine is shutting down", rid)
        if req["op"] == "set_config":
            call = ControlCall(dict(req["values"]), rid)
        else:
            call = ControlCall({k: v for k, v in req.items() if k not in ("op", "id", "key")},
                               rid, op=req["op"])
        self._submit(call)
        if call.done.wait(CONTROL_WAIT_S):
            return call.reply or control.error_reply("no reply", rid)
        with call.lock:
            if call.reply is None:
                call.cancelled = True
                return control.error_reply(f"the engine did not reach a step boundary within "
                                           f"{CONTROL_WAIT_S:g} s; nothing was applied", rid)
        return call.reply
