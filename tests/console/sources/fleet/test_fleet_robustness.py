"""A fleet's readers keep going whatever a target answers: a Prometheus that answers junk, a
scrape whose folding-in fails, a bad key for one engine of ours; a multi-rank server keeps its
latency figures (its ranks' histograms summed); the rows notice new alerts however many came."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from support.vllm_metrics import VllmMetrics
from vconsole.console.engine_state import Alert
from vconsole.console.sources.fleet.control import set_one
from vconsole.console.sources.fleet.prometheus_query import PrometheusSource
from vconsole.console.sources.fleet.rows import Fleet
from vconsole.console.sources.fleet.sources import ScrapeSource
from vconsole.console.sources.fleet.targets import make_target
from vconsole.console.state import ConsoleState
from vconsole.telemetry.record import Recorder

EMPTY = b'{"status": "success", "data": {"resultType": "vector", "result": []}}'


class JunkThenProm:
    """A TCP server on a free port that answers bytes that are not HTTP until ``heal`` is
    set, then a real (empty) Prometheus query answer."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen()
        self.port = self.server.getsockname()[1]
        self.heal = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    conn.recv(65536)
                    if self.heal.is_set():
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                                     % (len(EMPTY), EMPTY))
                    else:
                        conn.sendall(b"\xff\x00\x00\x00\x01\x7fnot http at all\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()


@pytest.fixture
def junk() -> Iterator[JunkThenProm]:
    server = JunkThenProm()
    yield server
    server.close()


def _until(cond, what: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_prometheus_answering_junk_is_one_line_and_the_reader_recovers(junk) -> None:
    state = ConsoleState()
    source = PrometheusSource(f"http://127.0.0.1:{junk.port}", interval_s=0.1, timeout_s=1.0)
    assert not source.read_once()                       # `top --prometheus --once`'s read
    assert "not an HTTP server" in (source.problem or ""), source.problem
    source.start(state)
    try:
        _until(lambda: source.failures >= 2, "the reader stopped reading")
        assert source._thread is not None and source._thread.is_alive()
        assert source.error is None and "not an HTTP server" in (source.problem or "")
        assert (state.recent_error() or "").startswith("PROMETHEUS UNREACHABLE")
        junk.heal.set()
        _until(lambda: source.reading is not None, "never recovered")
        assert source.problem is None and source._thread.is_alive()
    finally:
        source.stop()


@pytest.fixture
def vllm2() -> Iterator[tuple[VllmMetrics, str]]:
    vm = VllmMetrics(engines=2)
    url = vm.serve()
    yield vm, url
    vm.close()


def test_a_scrape_target_whose_reads_fail_after_the_scrape_keeps_its_thread(vllm2, tmp_path):
    vm, url = vllm2
    vm.step("0", running=1, waiting=0, usage=0.1)
    vm.step("1", running=1, waiting=0, usage=0.1)
    state = ConsoleState()
    source = ScrapeSource(make_target("vllm", url, name="v"), interval_s=0.1)
    closed = Recorder(str(tmp_path / "closed.vtrec"))
    closed.close()                        # its writes raise (a recording ended under it)
    source.record_into(closed)
    source.start(state)
    try:
        _until(lambda: source.problem is not None, "no problem said")
        assert source._thread is not None and source._thread.is_alive()
        assert source.error is None, source.error
        good = Recorder(str(tmp_path / "good.vtrec"))
        source.record_into(good)
        _until(lambda: source.problem is None and source.recorded > 0, "never recovered")
        assert source._thread.is_alive()
    finally:
        source.stop()
        source.stop_recording()


def test_a_multi_rank_server_keeps_ttft_and_itl_and_joins_the_fleets_percentiles(vllm2):
    vm, url = vllm2
    vm.step("0", running=1, waiting=0, usage=0.2, generation=50, finished=50, ttft=0.03,
            itl=0.02)
    vm.step("1", running=1, waiting=0, usage=0.2, generation=50, finished=50, ttft=0.7,
            itl=0.2)
    state = ConsoleState()
    source = ScrapeSource(make_target("vllm", url, name="v"))
    assert source.scrape_once(state), source.problem
    fleet = Fleet([source], window_s=0, started=time.time())
    row = fleet.rows(state, time.time())[0]
    assert row.state == "up"
    # half the requests in each rank: the summed histogram's median is rank 0's, p99 rank 1's
    assert row.ttft_p50.value is not None and row.ttft_p50.value <= 0.04
    assert row.ttft_p99.value is not None and 0.5 < row.ttft_p99.value <= 0.75
    assert row.itl_p99.value is not None and 0.15 < row.itl_p99.value <= 0.2
    assert row.window["ttft_s"]["count"] == 100
    agg = fleet.aggregate([row])
    assert agg.ttft_p99.value == row.ttft_p99.value and agg.itl_p99.known


def test_a_new_alert_rebuilds_the_row_after_the_alert_list_is_full(vllm2):
    vm, url = vllm2
    vm.step("0", running=1, waiting=0, usage=0.2)
    state = ConsoleState()
    source = ScrapeSource(make_target("vllm", url, name="v"))
    assert source.scrape_once(state), source.problem
    fleet = Fleet([source], started=time.time())
    key = sorted(source.engine_keys)[0]
    engine, rank = key.rsplit("/", 1)
    for i in range(state.alerts.maxlen or 0):              # fill the list of alerts
        state.note_alert(Alert(time.time(), "other", 0, f"filler{i}", "warning", 1, 0, ""))
    now = time.time()
    assert fleet.rows(state, now)[0].alerts == []
    state.note_alert(Alert(now, engine, int(rank), "waiting", "warning", 40, 32,
                           "40 waiting"))
    assert fleet.rows(state, now)[0].alerts == ["waiting"]


def test_a_bad_curve_key_for_one_engine_is_its_own_line(tmp_path: Path) -> None:
    public = tmp_path / "server.key"
    public.write_text('metadata\ncurve\n    public-key = "' + "~" * 40 + '"\n')  # not Z85
    _, secret = zmq.auth.create_certificates(str(tmp_path), "client")
    Path(secret).chmod(0o600)
    control = tmp_path / "control.key"
    control.write_text("a" * 64 + "\n")
    control.chmod(0o600)
    target = make_target("vconsole", "tcp://127.0.0.1:45810", name="x",
                         curve={"server_public": str(public), "client_key": secret},
                         control_key_file=str(control))
    ok, lines = set_one(target, {"max_num_seqs": "8"})
    assert not ok and len(lines) == 1 and lines[0].startswith("not sent: ZMQError"), lines


def test_the_fleets_kv_use_weighs_each_target_by_its_capacity() -> None:
    small, big = VllmMetrics(engines=1, num_gpu_blocks=1000), VllmMetrics(engines=1,
                                                                           num_gpu_blocks=3000)
    small.step("0", running=1, waiting=0, usage=0.9)
    big.step("0", running=1, waiting=0, usage=0.1)
    try:
        state = ConsoleState()
        sources = [ScrapeSource(make_target("vllm", m.serve(), name=n))
                   for n, m in (("small", small), ("big", big))]
        assert all(s.scrape_once(state) for s in sources)
        fleet = Fleet(sources, started=time.time())
        rows = fleet.rows(state, time.time())
        assert [r.kv_capacity_tokens for r in rows] == [16_000, 48_000]
        # 0.9 of 16k tokens and 0.1 of 48k: 19.2k of 64k in use, not the mean 0.5
        assert fleet.aggregate(rows).kv_usage == pytest.approx(0.3)
    finally:
        small.close()
        big.close()
