"""`vconsole set` / `vconsole get` against a real engine: exit codes and the text people read."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from vconsole.cli import build_parser
from vconsole.commands.control import main_get, main_set, parse_pairs
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.security import control_key, engine_key


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("ctl")
    eps = {n: f"ipc://{d}/{n}" for n in ("input", "output", "telemetry", "control")}
    with EngineProcess(["--num-kv-blocks", "16", "--max-num-seqs", "4"], endpoints=eps,
                       log_path=d / "engine.log") as proc:
        yield proc


def vconsole(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vconsole.cli", *argv], capture_output=True,
                          text=True, timeout=60)


def run(func, argv, capsys, **extra):
    args = build_parser().parse_args(argv)
    for k, v in extra.items():
        setattr(args, k, v)
    code = func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_parse_pairs():
    assert parse_pairs(["max-num-seqs=8", "policy = priority"]) == {"max_num_seqs": "8",
                                                                    "policy": "priority"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_pairs(["max_num_seqs"])


@pytest.mark.proc
def test_set_applies_all_pairs_at_once_and_exits_zero(engine):
    r = vconsole("set", "--control", engine.endpoints["control"], "max_num_seqs=3",
                 "policy=priority")
    assert r.returncode == 0, r.stderr
    assert "applied  max_num_seqs = 3" in r.stdout and "applied  policy = priority" in r.stdout
    r = vconsole("get", "--control", engine.endpoints["control"], "max_num_seqs", "policy",
                 "--json")
    assert r.returncode == 0
    assert json.loads(r.stdout)["values"] == {"max_num_seqs": 3, "policy": "priority"}


@pytest.mark.proc
def test_set_rejects_bad_values_with_reasons_and_changes_nothing(engine, capsys):
    ctl = engine.endpoints["control"]
    code, out, err = run(main_set, ["set", "--control", ctl, "max_num_seqs=0",
                                    "telemetry_hz=fast", "log_stats=true"], capsys)
    assert code == 1
    assert "rejected  max_num_seqs: must be >= 1" in err
    assert "rejected  telemetry_hz: expected a number" in err
    assert "nothing was applied" in err and "applied" not in out
    code, out, _ = run(main_get, ["get", "--control", ctl, "log_stats"], capsys)
    assert code == 0 and "false" in out


@pytest.mark.proc
def test_set_restart_only_key_exits_nonzero_with_the_reason(engine, capsys):
    code, _, err = run(main_set, ["set", "--control", engine.endpoints["control"],
                                  "block_size=32"], capsys)
    assert code == 1 and "restart required  block_size" in err


@pytest.mark.proc
def test_set_unknown_key_and_malformed_pair(engine, capsys):
    code, _, err = run(main_set, ["set", "--control", engine.endpoints["control"],
                                  "no_such_key=1"], capsys)
    assert code == 1 and "rejected  no_such_key: unknown key" in err
    code, _, err = run(main_set, ["set", "--control", engine.endpoints["control"], "oops"],
                       capsys)
    assert code == 2 and "expected KEY=VALUE" in err


@pytest.mark.proc
def test_get_prints_the_effective_config_with_hot_and_restart_kinds(engine, capsys):
    code, out, _ = run(main_get, ["get", "--control", engine.endpoints["control"]], capsys)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert rows["num_kv_blocks"][1:] == ["16", "restart"]
    assert rows["max_num_seqs"][-1] == "hot"
    assert rows["max_holding_seconds"][1] == "(unset)"
    assert "config version" in out.splitlines()[-1]
    code, _, err = run(main_get, ["get", "--control", engine.endpoints["control"], "nope"],
                       capsys)
    assert code == 1 and "unknown key(s): nope" in err


@pytest.mark.proc
def test_set_without_the_key_file_exits_1_naming_the_path_and_changes_nothing(engine, tmp_path,
                                                                            capsys):
    ctl = engine.endpoints["control"]
    before = json.loads(vconsole("get", "--control", ctl, "--json").stdout)
    missing = tmp_path / "nope.key"
    r = vconsole("set", "--control", ctl, "--control-key-file", str(missing), "max_num_seqs=2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot read the engine's control key {missing} (no such file)" in r.stderr
    assert "--control-key-file" in r.stderr
    # The default path is the one the engine wrote; take it away and the bare command says so.
    default = control_key.control_key_file(ctl)
    assert default == engine.control_key_file and default.exists()
    hidden = tmp_path / "hidden.key"
    shutil.copy2(default, hidden)
    os.rename(default, tmp_path / "moved.key")
    try:
        code, out, err = run(main_set, ["set", "--control", ctl, "max_num_seqs=2"], capsys)
        assert code == 1 and not out
        assert f"control key {default} (no such file)" in err
        # A copy of the key file elsewhere works through --control-key-file (the ssh recipe).
        code, out, _ = run(main_set, ["set", "--control", ctl, "--control-key-file", str(hidden),
                                      "max_num_seqs=2"], capsys)
        assert code == 0 and "applied  max_num_seqs = 2" in out
        code, out, _ = run(main_set, ["set", "--control", ctl, "--control-key-file", str(hidden),
                                      f"max_num_seqs={before['values']['max_num_seqs']}"],
                           capsys)
        assert code == 0
    finally:
        os.rename(tmp_path / "moved.key", default)
    after = json.loads(vconsole("get", "--control", ctl, "--json").stdout)
    assert after["values"] == before["values"]


@pytest.mark.proc
def test_set_with_a_wrong_key_is_not_authorised(engine, tmp_path, capsys):
    ctl = engine.endpoints["control"]
    wrong = engine_key.write_key_file(tmp_path / "wrong.key", engine_key.new_key())
    code, out, err = run(main_set, ["set", "--control", ctl, "--control-key-file", str(wrong),
                                    "max_num_seqs=2"], capsys)
    assert code == 1 and not out
    assert "not authorised: this client does not hold the engine's control key" in err
    code, out, _ = run(main_get, ["get", "--control", ctl, "max_num_seqs"], capsys)
    assert code == 0 and "2" not in out.splitlines()[1]


@pytest.mark.parametrize("func,argv", [(main_set, ["set", "max_num_seqs=2"]),
                                       (main_get, ["get"])])
def test_no_engine_is_a_clear_error_and_exit_1(func, argv, tmp_path, capsys):
    key = engine_key.write_key_file(tmp_path / "k.key", engine_key.new_key())
    code, _, err = run(func, [*argv, "--control", f"ipc://{tmp_path}/none",
                              "--control-key-file", str(key)], capsys, timeout=0.3)
    assert code == 1
    assert "no reply from the engine's control socket" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["set", "max_num_seqs=8"], ["profile"]])
def test_without_an_engine_set_and_profile_say_that_no_engine_answers(argv, tmp_path):
    r = vconsole(*argv, "--control", f"ipc://{tmp_path}/none",
                 "--control-key-file", str(tmp_path / "missing.key"))
    assert r.returncode == 1
    assert f"no engine answers on ipc://{tmp_path}/none" in r.stderr, r.stderr
    assert "control key" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.proc
def test_a_misspelt_key_gets_a_suggestion(engine, capsys):
    code, _, err = run(main_set, ["set", "--control", engine.endpoints["control"],
                                  "max_seqs=8"], capsys)
    assert code == 1 and "rejected  max_seqs: unknown key (did you mean max_num_seqs?)" in err


@pytest.mark.proc
@pytest.mark.parametrize("argv", [["get"], ["top", "--once", "--json"]])
def test_output_piped_into_head_ends_quietly(engine, argv):
    """`vconsole get | head`: the reader leaves early; no BrokenPipeError traceback."""
    flag = "--control" if argv[0] == "get" else "--telemetry"
    ep = engine.endpoints["control" if argv[0] == "get" else "telemetry"]
    cmd = [sys.executable, "-m", "vconsole", *argv, flag, ep]
    # `true` leaves at once: every write the command makes meets a closed pipe.
    r = subprocess.run(" ".join(cmd) + " | true", shell=True, capture_output=True,
                       text=True, timeout=60)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr


@pytest.mark.proc
def test_top_once_without_json_prints_a_status_line(engine):
    r = vconsole("top", "--once", "--telemetry", engine.endpoints["telemetry"],
                 "--control", engine.endpoints["control"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and not lines[0].startswith("{")
    assert "run=" in lines[0] and "kv=" in lines[0] and "steps=" in lines[0]


@pytest.mark.proc
def test_top_once_json_is_strict_json_with_inf_as_a_string(engine):
    """Latency histograms end in a +Inf bucket: Python would print ``Infinity``, which is not
    JSON (a browser's or Go's parser refuses it); top writes it as Prometheus does, "+Inf"."""
    r = vconsole("top", "--once", "--json", "--telemetry", engine.endpoints["telemetry"],
                 "--control", engine.endpoints["control"])
    assert r.returncode == 0, r.stderr

    def not_json(name: str) -> None:
        raise AssertionError(f"{name} in top's JSON")
    snap = json.loads(r.stdout, parse_constant=not_json)
    bounds = next(iter(snap["latency"]["overall"]["histograms"].values()))["bounds"]
    assert bounds[-1] == "+Inf" and all(isinstance(b, float) for b in bounds[:-1])
