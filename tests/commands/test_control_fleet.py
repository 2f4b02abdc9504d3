"""`vconsole set --fleet FILE KEY=VALUE`: two real engines of ours and an SGLang stand-in in one
fleet file. It lists what it will change and what it will not touch, asks once, changes our
engines one at a time and reports each one's answer; the other kind is never sent anything."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from support.ports import free_bases, free_block
from support.sglang_metrics import SglangMetrics
from vconsole.commands.control_fleet import main_set_fleet
from vconsole.engine.launch.engine_process import EngineProcess, loopback_endpoints
from vconsole.wire.control_client import ControlClient

pytestmark = [pytest.mark.proc, pytest.mark.slow]
BASES = free_bases(2)
SGLANG_PORT = free_block(1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], list[EngineProcess]]]:
    work = tmp_path_factory.mktemp("set-fleet")
    env = {"VCONSOLE_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    procs = [EngineProcess(["--model", "tiny", "--num-kv-blocks", "32", "--max-num-seqs", "8"],
                           endpoints=loopback_endpoints(b), env=env,
                           log_path=work / f"engine-{b}.log") for b in BASES]
    sg = SglangMetrics()
    url = sg.serve(SGLANG_PORT)
    path = work / "fleet.toml"
    path.write_text(f'[[engine]]\nname = "a"\nkind = "vconsole"\nurl = "tcp://127.0.0.1:{BASES[0]}"\n'
                    f'[[engine]]\nname = "b"\nurl = "tcp://127.0.0.1:{BASES[1]}"\n'
                    f'[[engine]]\nname = "sg"\nkind = "sglang"\nurl = "{url}"\n')
    try:
        for p in procs:
            p.start(timeout_s=120)
        yield str(path), env, procs
    finally:
        for p in procs:
            p.stop(grace_s=5)
        sg.close()


def max_num_seqs(proc: EngineProcess) -> int:
    with ControlClient(proc.endpoints["control"], timeout_s=5) as c:
        return int(c.get_config()["values"]["max_num_seqs"])


def test_a_no_sends_nothing_and_a_yes_changes_every_engine_of_ours(fleet, monkeypatch, capsys):
    path, env, procs = fleet
    monkeypatch.setenv("VCONSOLE_CACHE", env["VCONSOLE_CACHE"])
    args = argparse.Namespace(pairs=["max_num_seqs=3"], fleet=path, yes=False)
    asked: list[str] = []
    assert main_set_fleet(args, ask=lambda q: asked.append(q) or "no") == 1
    out = capsys.readouterr().out
    assert "max_num_seqs=3 on 2 engine(s)" in out and "not touched: sg (sglang: watched only)" \
        in out
    assert len(asked) == 1 and "not sent" in out
    assert [max_num_seqs(p) for p in procs] == [8, 8]

    r = subprocess.run([sys.executable, "-m", "vconsole", "set", "--fleet", path,
                        "max_num_seqs=3", "--yes"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    assert "a: applied  max_num_seqs = 3" in r.stdout and "b: applied  max_num_seqs = 3" \
        in r.stdout
    assert "2 of 2 engine(s) applied the change" in r.stdout
    assert [max_num_seqs(p) for p in procs] == [3, 3]


def test_without_a_terminal_it_asks_for_yes_and_sends_nothing(fleet):
    path, env, procs = fleet
    r = subprocess.run([sys.executable, "-m", "vconsole", "set", "--fleet", path,
                        "max_num_seqs=5"], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, env={**os.environ, **env})
    assert r.returncode == 2 and "confirm with --yes" in r.stderr
    assert 5 not in [max_num_seqs(p) for p in procs]


def test_a_refused_change_is_each_engines_own_line(fleet):
    path, env, _ = fleet
    r = subprocess.run([sys.executable, "-m", "vconsole", "set", "--fleet", path,
                        "max_num_seqs=0", "--yes"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})
    assert r.returncode == 1
    assert r.stderr.count("rejected  max_num_seqs") == 2 and "0 of 2" in r.stdout
