"""`vconsole top --once --json` and `vconsole attach` with fleet flags, as a user runs them: the
document's exact shape, the server's numbers in it, and one clear line for a bad flag."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from support.llama_cpp_stub import LlamaServerStub
from support.ports import free_block
from support.sglang_metrics import SglangMetrics

pytestmark = pytest.mark.proc
ENGINE_KEYS = {"name", "kind", "url", "state", "model", "running", "waiting", "kv_usage",
               "kv_usage_estimated", "gen_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_s",
               "prefix_hit", "preemptions_per_min"}
AGGREGATE_KEYS = {"engines_up", "running", "waiting", "gen_tok_s", "ttft_p99_s", "itl_p99_s"}

HTTP = free_block(3)     # an SGLang stand-in, a llama.cpp stub, a port nothing answers


def vconsole(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vconsole", *args], capture_output=True,
                          text=True, timeout=timeout, env={"HF_HUB_OFFLINE": "1",
                                                           "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    sg, ll = SglangMetrics(), LlamaServerStub()
    sg.step(running=2, waiting=4, used_tokens=1000, prompt=10, generation=10, finished=1)
    ll.busy(1, prompt=10, decoded=5)
    yield sg.serve(HTTP), ll.serve(HTTP + 1)
    sg.close()
    ll.close()


def test_once_json_is_the_documented_shape_with_the_servers_numbers(servers, tmp_path):
    sg_url, ll_url = servers
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[[engine]]\nname = "small"\nkind = "llama-cpp"\nurl = "{ll_url}"\n'
                     'labels = { pool = "cpu" }\n')
    r = vconsole("top", "--once", "--json", "--target", f"sglang={sg_url}",
                 "--fleet", str(fleet), "--target", f"auto=http://127.0.0.1:{HTTP + 2}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"engines", "aggregate", "imbalance"}
    assert [set(e) for e in doc["engines"]] == [ENGINE_KEYS, ENGINE_KEYS]
    assert set(doc["aggregate"]) == AGGREGATE_KEYS
    sg, small = doc["engines"]
    assert (sg["kind"], sg["running"], sg["waiting"], sg["state"]) == ("sglang", 2, 4, "up")
    assert (small["name"], small["kv_usage_estimated"], small["ttft_p99_s"]) == (
        "small", True, None)
    assert doc["aggregate"]["running"] == 3
    # the auto target that answers nothing: left out, with one line saying why
    assert f"127.0.0.1:{HTTP + 2}" in r.stderr and "Traceback" not in r.stderr


def test_once_as_text_has_a_line_per_engine_and_the_fleets(servers):
    sg_url, ll_url = servers
    r = vconsole("top", "--once", "--target", f"sglang={sg_url}", "--target",
                 f"llama-cpp={ll_url}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split()[:3] == ["NAME", "KIND", "STATE"]
    assert lines[-1].startswith("fleet") or any(x.startswith("fleet") for x in lines)


@pytest.mark.parametrize("args, says", [
    (["--target", "tgi=http://h:1"], "unknown kind 'tgi'"),
    (["--fleet", "/nonexistent/fleet.toml"], "No such file"),
    (["--discover", "127.0.0.1:9-1"], "a range of 1-1024 ports"),
])
def test_a_bad_fleet_flag_is_one_line_and_exit_2(args, says):
    for command in (["top", "--once"], ["attach"]):
        r = vconsole(*command, *args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
