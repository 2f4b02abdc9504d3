"""Every command line that worked when one function built the whole parser still gives the same
values, now that each command declares its own parser and `vconsole bench` has a subcommand per
benchmark.

``tests/data/command_lines_before.json`` is that parser's answer, kept as data: the command lines
of README.md, docs/*.md, the Makefile, scripts/ and tests/ (placeholders such as ``N`` or ``PORT``
filled with a value of their type), plus each benchmark's flags, parsed by ``build_parser`` as it
was at commit 6d0af78. Per command it holds the bare command's values (``defaults``); per line,
the values the line changed and its handler, or the exit code of a line that was refused or asked
for help.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import os
from pathlib import Path

import pytest

from vconsole.cli import build_parser
from vconsole.commands.subcommand import Handler

REPO = Path(__file__).resolve().parents[2]
BEFORE = json.loads((REPO / "tests/data/command_lines_before.json").read_text())
PARSED = [line for line in BEFORE["lines"] if "exit" not in line]
REFUSED = [line for line in BEFORE["lines"] if "exit" in line]
BENCH_HANDLERS = REPO / "vconsole/commands/bench.py"
# `vconsole bench NAME`: the names the one parser accepted.
BENCH_NAMES = ["throughput", "scheduler", "kvmap", "telemetry", "console", "dp", "soak", "serve",
               "quality", "kv-ideas", "kv-grouping", "whatif", "structured"]
# Benchmarks added since the data was taken: no line of before names them.
NEW_BENCH_NAMES = ["fleet", "build-llama-server", "spec", "metrics"]

# Flags a benchmark gained since, each defaulting to what a line of before did (issue 48: the
# quality bench's chunk and text, kv-grouping's text; issue 44: whatif's workloads).
ADDED = {"quality": {"chunk": None, "text": "pydoc"}, "kv-grouping": {"text": "pydoc"},
         "whatif": {"workloads": "demo,serve", "trace_dir": None, "seed": None},
         "throughput": {"concurrency": None, "base_port": 0},   # issue 47: --peer llama-server
         "telemetry": {"kv_cache_metrics": False, "enable_mfu_metrics": False,   # issue 46
                       "collect_detailed_traces": False}}


def parse(argv: list[str]) -> tuple[str, dict[str, object]]:
    """The handler's ``module:function`` and the other values, with this directory spelled as
    the data spells it (``--request-trace`` is made absolute)."""
    values = vars(build_parser().parse_args(argv))
    func = values.pop("func")
    assert isinstance(func, Handler)
    cwd = os.getcwd() + "/"
    return func.target, {k: "$CWD/" + v[len(cwd):] if isinstance(v, str) and v.startswith(cwd)
                         else v for k, v in values.items()}


def test_the_data_covers_every_command_and_every_benchmark():
    commands = {line["argv"][0] for line in PARSED}
    parser_commands = set(subparsers(build_parser()))
    assert parser_commands == commands
    named = {line["changed"].get("name", "throughput") for line in PARSED
             if line["argv"][0] == "bench"}
    assert named == set(BENCH_NAMES)
    assert set(BENCH_NAMES) | set(NEW_BENCH_NAMES) == set(benches())


@pytest.mark.parametrize("line", PARSED, ids=[" ".join(line["argv"]) for line in PARSED])
def test_a_command_line_of_before_gives_the_same_values_and_handler(line):
    before = {**BEFORE["defaults"][line["argv"][0]], **line["changed"]}
    target, now = parse(line["argv"])
    if before["command"] != "bench":
        assert target == line["handler"]
        assert {k: now.get(k, "<absent>") for k in before} == before
        return
    # A benchmark's parser has only its own flags: what it has is what the one parser gave,
    # and every flag the line gives is one of them.
    assert target == f"vconsole.commands.bench:{before['name'].replace('-', '_')}"
    for flag, default in ADDED.get(before["name"], {}).items():
        assert now.pop(flag) == default
    assert set(now) <= set(before)
    assert {k: before[k] for k in now} == now
    assert set(line["changed"]) <= set(now)


@pytest.mark.parametrize("line", REFUSED, ids=[" ".join(line["argv"]) for line in REFUSED])
def test_a_command_line_refused_before_is_refused_and_help_is_help(line):
    with (pytest.raises(SystemExit) as exc, contextlib.redirect_stdout(io.StringIO()),
          contextlib.redirect_stderr(io.StringIO())):
        build_parser().parse_args(line["argv"])
    assert exc.value.code == line["exit"]


def test_a_benchmark_refuses_another_benchmarks_flag_with_its_own_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "kvmap", "--model-config", "tiny"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("usage: vconsole bench kvmap ")
    assert "vconsole bench kvmap: error: unrecognized arguments: --model-config tiny" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--rond", "2"])
    assert "(did you mean --rounds?)" in capsys.readouterr().err


@pytest.mark.parametrize("name", BENCH_NAMES + NEW_BENCH_NAMES)
def test_each_benchmark_has_its_own_help_with_only_its_own_flags(name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", name, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith(f"usage: vconsole bench {name} ")
    flags = {s for a in benches()[name]._actions for s in a.option_strings}
    for other in set().union(*({s for a in p._actions for s in a.option_strings}
                               for p in benches().values())) - flags:
        assert other + " " not in out, other


def test_each_benchmark_handler_reads_only_flags_its_parser_declares():
    """``args.X`` in a benchmark's handler is a flag of that benchmark (an attribute a parser
    lacks would be an AttributeError after the benchmark's minutes, not at the command line)."""
    tree = ast.parse(BENCH_HANDLERS.read_text())
    handlers = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    helpers = {name: reads(f) for name, f in handlers.items() if name.startswith("_")}
    for name, parser in benches().items():
        func = handlers[name.replace("-", "_")]
        read = reads(func) | set().union(*(helpers[c] for c in calls(func) if c in helpers))
        declared = {a.dest for a in parser._actions} | {"command", "name", "func"}
        assert read <= declared, (name, read - declared)


def test_every_handler_the_parser_names_exists():
    for target in handlers_of(build_parser()):
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def benches() -> dict[str, argparse.ArgumentParser]:
    return subparsers(subparsers(build_parser())["bench"])


def handlers_of(parser: argparse.ArgumentParser) -> set[str]:
    out = set()
    for sub in subparsers(parser).values():
        func = sub.get_default("func")
        if func is None:
            out |= handlers_of(sub)
        else:
            out.add(func.target)
    return out


def reads(func: ast.FunctionDef) -> set[str]:
    return {n.attr for n in ast.walk(func) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "args"}


def calls(func: ast.FunctionDef) -> set[str]:
    return {n.func.id for n in ast.walk(func) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)}
