"""`vconsole top` / `attach` with ``--prometheus``, as a user types them: a flag that cannot be
used is one line and exit 2; a Prometheus that is not there is one line and exit 1, no
traceback. (What a live Prometheus gives: tests/console/sources/fleet/test_fleet_prometheus.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.ports import free_port

pytestmark = pytest.mark.proc


def vconsole(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vconsole", *args], capture_output=True,
                          text=True, timeout=60, env={"HF_HUB_OFFLINE": "1",
                                                      "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("args, says", [
    (["--selector", '{job="x"}'], "--selector: only with --prometheus URL"),
    (["--prometheus", "http://127.0.0.1:47390", "--target", "vllm=http://h:1"],
     "--prometheus: not with --target"),
    (["--prometheus", "ftp://h:9090"], "an HTTP URL"),
    (["--prometheus", "http://127.0.0.1:47390", "--selector", "vllm:num_requests_running"],
     "label matchers only"),
    (["--prometheus", "http://127.0.0.1:47390", "--selector", '{job="x"'], "unbalanced"),
])
def test_a_prometheus_flag_that_cannot_be_used_is_one_line_and_exit_2(args, says):
    for command in (["top", "--once", "--json"], ["attach"]):
        r = vconsole(*command, *args)
        assert r.returncode == 2, (command, r.stderr)
        assert says in r.stderr and "Traceback" not in r.stderr


def test_a_prometheus_that_is_not_there_is_one_line_and_exit_1():
    port = free_port()                            # nothing listens there
    r = vconsole("top", "--prometheus", f"http://127.0.0.1:{port}", "--once", "--json")
    assert r.returncode == 1 and r.stdout == ""
    assert f"127.0.0.1:{port}" in r.stderr and "refused" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1


def test_each_browser_tab_of_attach_web_reads_the_same_prometheus():
    import argparse

    from vconsole.commands.attach import console_argv

    argv = console_argv(argparse.Namespace(prometheus="http://prom:9090",
                                           selector='{job="vllm"}', readonly=True))
    assert argv[-6:] == ["attach", "--prometheus", "http://prom:9090", "--selector",
                         '{job="vllm"}', "--readonly"]
    r = vconsole("attach", "--web", "--selector", '{job="x"}')
    assert r.returncode == 2 and "--selector: only with --prometheus URL" in r.stderr
