"""`vconsole demo`: engine + load generator + console, started and stopped as one."""

from __future__ import annotations

import argparse
import sys

from vconsole.commands import fail
from vconsole.commands.demo_defaults import DEFAULT_BASE_PORT
from vconsole.commands.flags import BASE_PORT_ENV
from vconsole.engine.kernel_cache import EXPECTED_BUILD
from vconsole.engine.launch.engine_process import EngineProcess
from vconsole.tools.demo import (
    DEMO_SETTINGS,
    PORTS,
    DemoModel,
    DemoStack,
    demo_model,
    free_base_port,
    prepare_model,
)

_PASS_THROUGH = ("device", "dtype", "block_size", "num_kv_blocks", "kv_cache_dtype",
                 "kv_cache_memory_bytes", "quantization", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "policy", "config")


def model_from(args: argparse.Namespace) -> DemoModel:
    return demo_model(getattr(args, "model", None), getattr(args, "config", None))


def engine_args_from(args: argparse.Namespace, model: DemoModel | None = None) -> list[str]:
    """The demo's engine flags: its model, the user's flags, plus the model's demo defaults
    unless a --config file decides, and the demo's settings (request text on the console)
    before the user's own ``--set`` (which win)."""
    model = model or model_from(args)
    out: list[str] = ["--model", model.name] if model.name is not None else []
    for key in _PASS_THROUGH:
        value = getattr(args, key, None)
        if value is None:
            value = model.engine_defaults.get(key)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    if getattr(args, "no_prefix_caching", False):
        out.append("--no-prefix-caching")
    for pair in [*DEMO_SETTINGS, *(getattr(args, "overrides", None) or [])]:
        out += ["--set", pair]
    return out


def main(args: argparse.Namespace) -> int:
    model = model_from(args)
    print(f"vconsole demo: {model.why}", file=sys.stderr, flush=True)
    try:
        prepare_model(model, lambda line: print(f"vconsole demo: {line}", file=sys.stderr,
                                                flush=True))
    except ValueError as e:
        return fail("demo", e)
    wanted = args.base_port or DEFAULT_BASE_PORT     # --base-port, else $VCONSOLE_BASE_PORT
    try:
        base = free_base_port(wanted)
    except ValueError as e:
        return fail("demo", e, 2)
    for line in port_lines(wanted, base):
        print(line, file=sys.stderr, flush=True)
    stack = DemoStack(engine_args_from(args, model),
                      rate=args.rate if args.rate is not None else model.rate,
                      base_port=base,
                      on_phase=lambda phase: print(f"vconsole demo: the engine is {phase}, "
                                                   f"{EXPECTED_BUILD} ...", file=sys.stderr,
                                                   flush=True))
    print("vconsole demo: starting the engine ...", file=sys.stderr, flush=True)
    try:
        stack.start()
    except RuntimeError as e:
        return fail("demo", e)
    try:
        from vconsole.console.app import VConsoleApp
        app = VConsoleApp(telemetry_endpoints=[stack.endpoints["telemetry"]],
                          control_endpoint=stack.endpoints["control"],
                          control_key=stack.engine.control_key(),
                          control_key_file=stack.engine.control_key_file,
                          engine_address=f"127.0.0.1:{base}")
        if stack.load is not None:     # its errors on screen, not only after the fact
            stack.load.on_error = lambda e: app.state.note_error(f"load generator: {e}")
        app.run()
    finally:
        stack.close()
        line, code = closing_line(stack.engine)
        print(f"vconsole demo: {stack.summary().line()}", file=sys.stderr)
        print(f"vconsole demo: {line}", file=sys.stderr)
        if base != DEFAULT_BASE_PORT:       # the lines before the console may be gone by now
            print(f"vconsole demo: its engine was on {_ports(base)} "
                  f"(export {BASE_PORT_ENV}={base})", file=sys.stderr)
    if stack.load is not None and stack.load.error is not None:
        print(f"vconsole demo: the load generator failed {stack.load.errors} time(s), last: "
              f"{stack.load.error!r}", file=sys.stderr)
    return code


def port_lines(wanted: int, base: int) -> list[str]:
    """Where the demo's engine listens, said before the console takes the screen: on the
    default ports every other command finds it; elsewhere, the line that points another
    shell's commands there."""
    if base == wanted == DEFAULT_BASE_PORT:
        return [f"vconsole demo: the engine listens on the default ports, {_ports(base)}"]
    where = (f"{_ports(wanted)} is in use: the engine listens on {_ports(base)}"
             if base != wanted else f"the engine listens on {_ports(base)}")
    return [f"vconsole demo: {where}", "vconsole demo: in another shell, before vconsole get, "
            "set, top or attach:", f"    export {BASE_PORT_ENV}={base}"]


def _ports(base: int) -> str:
    return f"127.0.0.1:{base}-{base + PORTS - 1}"


def closing_line(engine: EngineProcess) -> tuple[str, int]:
    """What the demo says when it ends, and its exit code: an engine that was restarted or
    failed is never a clean exit, and its log (kept) is named."""
    if engine.restart_count:
        return (f"engine restarted {engine.restart_count} times (last: "
                f"{engine.restart_reason}); log: {engine.log_path}", 1)
    if engine.failed:
        code = engine.child.returncode if engine.child else None
        return f"the engine failed (exit code {code}); its log: {engine.log_path}", 1
    if engine.keep_log:
        return f"stopped (engine log: {engine.log_path})", 0
    return "stopped", 0
