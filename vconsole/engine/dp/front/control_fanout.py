"""ControlFanout: the data-parallel front end's control endpoint, one config for N ranks.

Clients speak the lone engine's control protocol (`vconsole.wire.control`) to one
endpoint, with one control key (its own 0600 file, same rules as a lone engine's:
`vconsole.security.engine_key`). A request may carry ``"rank": R`` to address one rank.

- ``set_config`` is validated ONCE, here, against the same table every rank uses
  (`vconsole.shared.config.apply_update` over the addressed rank's current config): a change
  refused there is refused for every rank and nothing is sent. Otherwise it goes to every rank
  (or only ``rank``), each applying it atomically between two of its steps; the reply carries
  each rank's acknowledgement, ``"ranks": {"0": {...}, "1": {...}}``, and is ``ok`` only when
  every addressed rank applied it (its ``error`` names the ranks that did not). Request text
  (``publish_request_text``) is refused here when the public telemetry socket may not carry it
  (``text_refusal``): the ranks publish on private sockets and could not tell.
- ``get_config`` and ``profile_status`` answer rank 0's (or ``rank``'s) reply;
  ``profile_start`` / ``profile_cancel`` go to that one rank (key required).

The front end talks to each rank's control socket with that rank's own key: read from the file
its ready record names, or, for ranks on other hosts (``rank_curve``: every connection to a rank
is a CURVE client), the key the rank's ``ready`` carried over that channel (`set_key`); such a
rank's file is never read (it is on the rank's host). Thread ``dp-control`` owns the ROUTER; `set_rank` / `rank_down` are
safe from any thread. Invariant: every well-formed request gets exactly one reply.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import zmq

from vconsole.security import engine_key
from vconsole.security.bind_policy import bind_socket
from vconsole.security.control_key import control_key_file as derive_key_file
from vconsole.security.control_key import read_key_file
from vconsole.shared.config import ConfigError, apply_update, validate_config
from vconsole.telemetry.request_text import KEY, turns_on
from vconsole.wire import control
from vconsole.wire.control_client import ControlClient

if TYPE_CHECKING:
    from vconsole.security.curve import ClientCurve
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine.dp")

POLL_MS = 200
RANK_TIMEOUT_S = 35.0     # a rank answers a set_config within its CONTROL_WAIT_S (30 s)
KEYED = ("set_config", "profile_start", "profile_cancel")


class ControlFanout:
    def __init__(self, endpoint: str, world_size: int, *, control_key_file: str | None = None,
                 ctx: zmq.Context | None = None, curve: ServerCurve | None = None,
                 engine_id: str = "dp-frontend",
                 rank_curve: ClientCurve | None = None, text_refusal: str | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.text_refusal = text_refusal
        self.rank_curve = rank_curve
        self.world_size = world_size
        self._sock = bind_socket(self.ctx, zmq.ROUTER, "control", endpoint, curve)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._key = engine_key.new_key()
        self.control_key_file = derive_key_file(self.endpoint, control_key_file)
        try:
            engine_key.claim_key_file(self.control_key_file, self._key, engine_id=engine_id,
                                      endpoint=self.endpoint)
        except OSError:
            self._sock.close(0)
            raise
        self._ranks: dict[int, tuple[str, str | None]] = {}   # rank -> (control, key file)
        self._keys: dict[int, str] = {}       # rank -> control key from its ready (CURVE)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dp-control", daemon=True)

    def start(self) -> ControlFanout:
        self._thread.start()
        return self

    def set_rank(self, rank: int, endpoint: str, control_key_file: str | None) -> None:
        with self._lock:
            self._ranks[rank] = (endpoint, control_key_file)
            self._keys.pop(rank, None)      # a new process: its ready brings its key

    def set_key(self, rank: int, key: str) -> None:
        """``rank``'s control key, as its ``ready`` sent it over CURVE."""
        with self._lock:
            self._keys[rank] = key

    def rank_down(self, rank: int) -> None:
        with self._lock:
            self._ranks.pop(rank, None)
            self._keys.pop(rank, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._sock.close(0)
            engine_key.remove_key_file(self.control_key_file, self._key)

    # --- the dp-control thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(POLL_MS):
                    continue
                frames = self._sock.recv_multipart()
                try:
                    reply = control.handle_frames(frames, self._on_request)
                except control.ControlError as e:
                    log.warning("control: dropped a malformed message: %s", e)
                    continue
                self._sock.send_multipart(reply)
        finally:
            self._sock.close(0)
            engine_key.remove_key_file(self.control_key_file, self._key)

    def _on_request(self, req: dict[str, Any]) -> dict[str, Any]:
        rid = req.get("id")
        rank = req.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.world_size):
            return control.error_reply(f"'rank' must be an integer from 0 to "
                                       f"{self.world_size - 1}, got {rank!r}", rid)
        if req["op"] in KEYED and not engine_key.key_matches(req.get("key"), self._key):
            return control.error_reply(engine_key.not_authorised(self.control_key_file), rid)
        fields = {k: v for k, v in req.items() if k not in ("op", "id", "key", "values", "rank")}
        if req["op"] == "set_config":
            return self._set_config(req["values"], rank, rid)
        target = 0 if rank is None else rank
        reply = self._ask(target, req["op"], req.get("values"), fields)
        return {**reply, "id": rid, "rank": target}

    def _ask(self, rank: int, op: str, values: dict[str, Any] | None,
             fields: dict[str, Any]) -> dict[str, Any]:
        """One rank's reply (never raises: a down or silent rank is an ``ok: false``)."""
        with self._lock:
            where = self._ranks.get(rank)
            key = self._keys.get(rank)
        if where is None:
            return control.error_reply(f"data-parallel rank {rank} is down")
        endpoint, control_key_file = where
        if key is None and self.rank_curve is not None:
            if op in KEYED:     # its file is on its host: the key comes with its ready only
                return control.error_reply(f"rank {rank} has not sent its control key yet "
                                           "(its ready is still on the way)")
        elif key is None and control_key_file:
            try:
                key = read_key_file(control_key_file)
            except (OSError, ValueError) as e:
                return control.error_reply(f"rank {rank}: cannot read its control key: {e}")
        client = ControlClient(endpoint, timeout_s=RANK_TIMEOUT_S, ctx=self.ctx, key=key,
                               curve=self.rank_curve)
        try:
            return client.request(op, values, fields=fields)
        except (TimeoutError, control.ControlError) as e:
            return control.error_reply(f"rank {rank}: {e}")
        finally:
            client.close()

    def _set_config(self, values: dict[str, Any], rank: int | None,
                    rid: int | None) -> dict[str, Any]:
        if self.text_refusal is not None and turns_on(values):
            return {**control.make_reply(ok=False, version=0, values=None,
                                         rejected={KEY: self.text_refusal},
                                         request_id=rid), "ranks": {}}
        targets = list(range(self.world_size)) if rank is None else [rank]
        current = self._ask(targets[0], "get_config", None, {})
        if not current.get("ok"):
            return {**current, "id": rid, "ranks": {}}
        try:
            update = apply_update(validate_config(current["values"]), values)
        except ConfigError as e:
            return control.error_reply(f"rank {targets[0]}'s config does not validate: {e}", rid)
        if not update.ok:   # refused by the table: refused for every rank, nothing sent
            return {**control.make_reply(ok=False, version=current.get("version", 0),
                                         values=current["values"], schema=current.get("schema"),
                                         rejected=update.rejected,
                                         restart_required=update.restart_required,
                                         request_id=rid), "ranks": {}}
        acks = {str(r): self._ask(r, "set_config", values, {}) for r in targets}
        failed = [r for r, a in acks.items() if not a.get("ok")]
        first = acks[str(targets[0])]
        ok = not failed
        error = None if ok else "; ".join(
            f"rank {r}: {acks[r].get('error') or 'refused'}" for r in failed)
        reply = control.make_reply(
            ok=ok, version=first.get("version", 0), values=first.get("values"),
            schema=first.get("schema"), applied=first.get("applied"),
            rejected={k: v for a in acks.values() for k, v in (a.get("rejected") or {}).items()},
            restart_required=sorted({k for a in acks.values()
                                     for k in a.get("restart_required") or []}),
            error=error, request_id=rid)
        reply["ranks"] = {r: {k: a.get(k) for k in ("ok", "error", "applied", "rejected",
                                                    "restart_required", "version")}
                          for r, a in acks.items()}
        return reply

