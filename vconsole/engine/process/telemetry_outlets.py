"""Where the engine process's figures leave it: the telemetry publisher, the KV event publisher
(``--kv-events-endpoint``) and Prometheus ``/metrics`` (``--metrics-port``).

`TelemetryOutlets.open` starts them once the core exists (the publisher's first ``config``
needs it) and takes back what it started when a later one fails; `close` stops them at the end
of the shutdown, after the final snapshot. The ``/metrics`` threads read only what the
publisher last sent (`vconsole.engine.publish.prometheus`).

Where they run: the telemetry publisher and ``/metrics`` in a child process
(`vconsole.engine.publish.publisher_process`: no Python thread of theirs competes with the busy
loop for the GIL), except on a CURVE engine, whose keys and ZAP handler live in this process's
ZeroMQ context — there they run here as threads, as before — or when the child cannot start
(then here too, with a warning). The KV event publisher (opt-in) stays here: it sends what the
busy loop drains after each step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from vconsole.engine.publish.bodies import KVFormat
from vconsole.engine.publish.kv_events import KVEventPublisher, start_kv_events
from vconsole.engine.publish.prometheus import MetricsServer, TelemetryCollector
from vconsole.engine.publish.publisher import TelemetryPublisher
from vconsole.engine.publish.publisher_process import ChildStartError
from vconsole.security.bind_policy import (
    request_text_refusal,
    secure_socket,
    secure_socket_warning,
)

if TYPE_CHECKING:
    from vconsole.engine.process.serving_core import ServingCore
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine")

PUBLISHER_CLOSE_S = 5.0   # at shutdown, how long the telemetry thread gets to stop


@dataclass(frozen=True)
class ChildMetrics:
    """``/metrics`` served by the publisher process: where (it stops with the process)."""

    url: str


@dataclass
class TelemetryOutlets:
    publisher: TelemetryPublisher
    kv_events: KVEventPublisher | None
    metrics: MetricsServer | ChildMetrics | None

    @classmethod
    def open(cls, ctx: zmq.Context, core: ServingCore, endpoint: str, *, device: str,
             curve: ServerCurve | None, restart_count: int, restart_reason: str | None,
             metrics_endpoint: tuple[str, int] | None) -> TelemetryOutlets:
        """Start the publisher on ``endpoint`` (its telemetry failures reported through it:
        the core's guard), then the others; raises after closing what it started. Request
        text asked for on a socket that may not carry it is turned off here, with a warning."""
        refusal = request_text_refusal(endpoint, curve is not None)
        if core.config.publish_request_text and refusal is not None:
            log.warning("%s It stays off.", refusal)
            core.apply_config({"publish_request_text": False})
        config = core.config

        def make(process: bool) -> TelemetryPublisher:
            return TelemetryPublisher(
                ctx, endpoint, config.engine_id, config.dp_rank, config,
                secure=None if process else lambda sock: secure_socket(
                    sock, "telemetry", endpoint, curve),
                restart_count=restart_count, restart_reason=restart_reason,
                detokenize=core.detokenize, text_refusal=refusal,
                kv_format=KVFormat.of(core.model_info()), process=process,
                metrics=metrics_endpoint if process else None, model_name=config.model)

        publisher = make(process=curve is None)
        if publisher.child is not None:     # (the in-process bind warns in secure_socket)
            secure_socket_warning("telemetry", endpoint)
        undo: list[Callable[[], object]] = [lambda: publisher.close(PUBLISHER_CLOSE_S)]
        try:
            try:
                publisher.start()
            except ChildStartError as e:
                log.warning("%s; the telemetry publisher runs in the engine process instead", e)
                publisher = make(process=False)
                publisher.start()
            kv_events = start_kv_events(ctx, config, device)
            if kv_events is not None:
                core.enable_kv_events()
                undo.append(kv_events.close)
            core.telemetry_guard.on_failure = publisher.report_error
            metrics: MetricsServer | ChildMetrics | None = None
            if publisher.metrics_url is not None:
                metrics = ChildMetrics(publisher.metrics_url)
            elif metrics_endpoint is not None:
                metrics = MetricsServer(TelemetryCollector(
                    publisher, model_name=config.model, engine=config.dp_rank),
                    *metrics_endpoint).start()
        except BaseException:
            for take_back in reversed(undo):
                take_back()
            raise
        return cls(publisher, kv_events, metrics)

    def publish_kv_events(self, core: ServingCore) -> None:
        """What entered and left the prefix cache since the last call (KV events on), behind
        the core's telemetry guard."""
        kv_events = self.kv_events
        if kv_events is not None:
            core.telemetry_guard.run("kv_events",
                                     lambda: kv_events.publish(core.take_kv_events()))

    def ready_fields(self) -> dict[str, Any]:
        """What the ready record says of them: the ``/metrics`` URL, the KV event endpoints."""
        fields: dict[str, Any] = {}
        if self.metrics is not None:
            fields["metrics"] = self.metrics.url
        if self.kv_events is not None:
            fields["kv_events"] = {"endpoint": self.kv_events.endpoint,
                                   "replay_endpoint": self.kv_events.replay_endpoint}
        return fields

    def close(self) -> None:
        """Stop them all; a telemetry thread that does not stop in time is left behind (its
        socket closes with the context); a publisher process that does not is killed."""
        if isinstance(self.metrics, MetricsServer):
            self.metrics.close()
        if self.kv_events is not None:
            self.kv_events.close(PUBLISHER_CLOSE_S)
        self.publisher.close(PUBLISHER_CLOSE_S)
        if self.publisher.is_alive():
            log.warning("the telemetry thread did not stop within %g s; closing its socket",
                        PUBLISHER_CLOSE_S)
