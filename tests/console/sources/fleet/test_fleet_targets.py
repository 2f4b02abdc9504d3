"""Targets from the command line, a fleet file and a discovery range: what each accepts, and
one clear error for what it does not."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from support.llama_cpp_stub import LlamaServerStub
from support.ports import free_block
from support.sglang_metrics import SglangMetrics
from vconsole.console.sources.fleet.detect import discover, kind_of_metrics, probe_port
from vconsole.console.sources.fleet.sources import ScrapeSource
from vconsole.console.sources.fleet.targets import (
    TargetError,
    load_fleet,
    make_target,
    parse_range,
    parse_target,
    unique_names,
)
from vconsole.console.state import ConsoleState


def test_a_target_flag_names_its_kind_and_url_and_a_bare_host_port_gets_its_scheme():
    t = parse_target("vllm=10.0.0.5:8000")
    assert (t.kind, t.url, t.name, t.readonly) == ("vllm", "http://10.0.0.5:8000",
                                                   "10.0.0.5:8000", True)
    ours = parse_target("vconsole=127.0.0.1:42100")
    assert (ours.url, ours.readonly) == ("tcp://127.0.0.1:42100", False)
    assert ours.endpoint(2) == "tcp://127.0.0.1:42102"      # telemetry: base + 2
    assert parse_target("http://h:1").kind == "auto"


@pytest.mark.parametrize("text, says", [
    ("tgi=http://h:1", "unknown kind 'tgi'"),
    ("vllm=", "no URL"),
    ("vconsole=http://h:1", "tcp://HOST:BASE_PORT"),
    ("sglang=tcp://h:1", "an HTTP URL"),
    ("vconsole=h", "needs HOST:PORT"),
])
def test_a_bad_target_is_one_clear_error(text, says):
    with pytest.raises(TargetError, match=says):
        parse_target(text)


def test_a_fleet_file_gives_names_kinds_labels_and_curve_keys(tmp_path):
    f = tmp_path / "fleet.toml"
    f.write_text('''
[[engine]]
name = "big-0"
kind = "vllm"
url = "http://10.0.0.5:8000"
kv_events = "tcp://10.0.0.5:5557"
labels = { pool = "a100" }

[[engine]]
url = "tcp://127.0.0.1:42100"
kind = "vconsole"
[engine.curve]
server_public = "/k/engine.key"
client_key = "/k/console.key_secret"

[[engine]]
url = "http://10.0.0.7:8080"
''')
    a, b, c = load_fleet(f)
    assert (a.name, a.kind, a.kv_events, a.labels) == ("big-0", "vllm", "tcp://10.0.0.5:5557",
                                                       {"pool": "a100"})
    assert (b.kind, b.curve["server_public"]) == ("vconsole", "/k/engine.key")
    assert (c.kind, c.name) == ("auto", "10.0.0.7:8080")


@pytest.mark.parametrize("text, says", [
    ("", "no \\[\\[engine\\]\\] tables"),
    ("[[engine]]\nname='x'\n", "engine 1: needs url"),
    ("[[engine]]\nurl='http://h:1'\nport=3\n", "unknown key\\(s\\) port"),
    ("[[engine]\n", "not TOML"),
    ("[[engine]]\nurl='http://h:1'\nkind='tgi'\n", "engine 1: unknown kind"),
])
def test_a_bad_fleet_file_says_which_engine_and_why(tmp_path, text, says):
    f = tmp_path / "fleet.toml"
    f.write_text(text)
    with pytest.raises(TargetError, match=says):
        load_fleet(f)


def test_a_missing_fleet_file_is_an_error_not_a_traceback(tmp_path):
    with pytest.raises(TargetError, match="No such file"):
        load_fleet(tmp_path / "none.toml")


def test_discovery_ranges_and_repeated_names():
    assert parse_range("127.0.0.1:42000-42003") == ("127.0.0.1", [42000, 42001, 42002, 42003])
    assert parse_range("h:42000") == ("h", [42000])
    for bad in ("h", "h:a-b", "h:9-1", "h:1-5000"):
        with pytest.raises(TargetError):
            parse_range(bad)
    names = [t.name for t in unique_names([parse_target("vllm=h:1")] * 3)]
    assert names == ["h:1", "h:1#2", "h:1#3"]


def test_metrics_text_says_its_kind():
    assert kind_of_metrics(SglangMetrics().text()) == "sglang"
    assert kind_of_metrics(LlamaServerStub().text()) == "llama-cpp"
    assert kind_of_metrics("# HELP x\nfoo 1\n") is None


def test_discover_finds_each_kind_and_reports_a_port_that_answers_nothing_known():
    sg, ll = SglangMetrics(), LlamaServerStub()
    base = free_block(3)
    sg.serve(base + 1)
    ll.serve(base + 2)
    try:
        found, skipped = discover("127.0.0.1", [base, base + 1, base + 2])
    finally:
        sg.close()
        ll.close()
    assert sorted((t.kind, t.url) for t in found) == [
        ("llama-cpp", f"http://127.0.0.1:{base + 2}"), ("sglang", f"http://127.0.0.1:{base + 1}")]
    assert len(skipped) == 1 and skipped[0].startswith(f"127.0.0.1:{base}: ")


@pytest.fixture
def not_http() -> Iterator[int]:
    """A TCP server that answers every connection with bytes that are not HTTP (as a ZeroMQ
    socket does), on a free port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7fnot http at all\r\n\r\n")
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield server.getsockname()[1]
    stop.set()
    t.join()
    server.close()


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llama-cpp"])
def test_a_port_that_does_not_speak_http_is_one_line_and_reads_go_on(not_http, kind):
    src = ScrapeSource(make_target(kind, f"127.0.0.1:{not_http}", name="x"))
    assert not src.scrape_once(ConsoleState())
    assert "not an HTTP server" in (src.problem or "")
    assert not src.scrape_once(ConsoleState()) and src.failures == 2
    assert "not an HTTP server" in str(probe_port("127.0.0.1", not_http, timeout_s=0.5))
