"""The request trace: what the engine served, request by request and step by step, in a file.

Written by the engine (`vconsole engine --request-trace FILE`, the hot ``request_trace`` key,
and the in-memory window a console asks for over the control channel); read by `vconsole load
--trace` (replay against an engine) and `vconsole whatif` (replay through the real scheduler
with a fitted step-time model). One JSON object per line, in this order::

    {"kind": "header", "version": 1, "model": ..., "block_size": 16, "num_kv_blocks": ...,
     "vocab_size": ..., "max_model_len": ..., "kv_cache_dtype": ..., "kv_bytes_per_token": ...,
     "kv_pool_bytes": ..., "engine_id": ..., "started_unix": ..., "config_version": 1,
     "config": {...every EngineConfig key...}}
    {"kind": "config", "t": 12.5, "config_version": 2, "config": {...}}   (a change, later)
    {"kind": "request", "arrival": 0.013, "first_token": 0.101, "finish": 0.73, ...}
    {"kind": "step", "t": 0.02, "dur": 0.031, "period": 0.033, "prefill": 120, ...}

Times are seconds on the engine's monotonic clock since the trace began (``started_unix`` is
the wall clock then). A request line is written when the request finishes and holds no text:
the prompt's length and the chained hashes of its full blocks (`prompt_block_hashes`: equal
hashes mean equal prefixes, as the prefix cache sees them), so a replay can build synthetic
prompts that share exactly the prefixes the real ones shared (`synthetic_prompt`).

`read_trace` refuses a file that is empty, cut short (a last line that is not whole JSON: the
writer only ever writes whole lines) or of another version, with the reason; a field it does
not know (a newer writer's addition within the version) is left unread. `read_csv` reads
public traces (Vidur's / Azure's CSV columns): arrivals and token counts only, no steps and no
shared prefixes.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace that cannot be used, with the reason a person reads."""


@dataclass
class TraceHeader:
    model: str | None
    block_size: int
    num_kv_blocks: int | None
    vocab_size: int | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None
    kv_bytes_per_token: int | None = None
    kv_pool_bytes: int | None = None
    # Bytes per token of every KV format on this model: a what-if of kv_cache_dtype is the
    # pool's bytes over these (capacity only).
    kv_bytes_per_token_by_dtype: dict[str, int] = field(default_factory=dict)
    # Exactly: [per token, per block] of every format, a block of B tokens taking B * per token
    # + per block bytes (older traces: absent, and the sizes above are used).
    kv_block_bytes_by_dtype: dict[str, list[int]] = field(default_factory=dict)
    # The widest step of decode (and draft) rows the engine runs as one native call, its
    # plan's width (0: none does; each step's ``native`` flag says which ran so): the regime
    # a what-if's simulated steps take (`whatif.cost_model`).
    native_decode_rows: int = 0
    engine_id: str | None = None
    started_unix: float = 0.0
    config_version: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    records_lost: int = 0           # steps or requests the engine could not keep (a hole)
    source: str = "vconsole"        # or "csv" (public traces: no steps, no prefixes)
    version: int = TRACE_VERSION


@dataclass(slots=True)
class RequestRecord:
    """One finished request. ``itl_us``: the gaps between its output tokens after the first,
    in microseconds (``output_len - 1`` of them when it finished normally)."""

    arrival: float
    finish: float
    prompt_len: int
    output_len: int
    max_tokens: int
    first_token: float | None = None
    block_hashes: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    finish_reason: str = "length"
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    config_version: int = 1
    itl_us: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepRecord:
    """One engine step. ``dur``: schedule + execute + update (s); ``period``: from this step's
    start to the next one's when the engine went straight on (work was left), else None.
    ``context``: the sum over scheduled rows of the positions they attend to (start + n);
    ``prefill_attn``: the sum over prefill chunks of n x (start + n), attention's cost.
    ``native``: the step ran as one native call (a small pure-decode step on the CPU), which
    costs less per step than the Python layers: the step-cost model's regime."""

    t: float
    dur: float
    execute: float
    prefill: int
    decode: int
    reqs: int
    running: int
    waiting: int
    context: int = 0
    prefill_attn: int = 0
    new_reqs: int = 0
    preempted: int = 0
    finished: int = 0
    kv_used: int = 0
    period: float | None = None
    native: bool = False        # ran as one native call (`native_decode`), not Python layers


@dataclass
class Trace:
    header: TraceHeader
    requests: list[RequestRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    configs: dict[int, dict[str, Any]] = field(default_factory=dict)   # version -> config
    config_times: dict[int, float] = field(default_factory=dict)       # version -> since (s)

    @property
    def duration_s(self) -> float:
        """First arrival to last finish (0 when empty)."""
        if not self.requests:
            return 0.0
        return max(r.finish for r in self.requests) - min(r.arrival for r in self.requests)

    def config_at(self, version: int) -> dict[str, Any]:
        return self.configs.get(version, self.header.config)


_REQUEST_FIELDS = tuple(f.name for f in fields(RequestRecord))
_STEP_FIELDS = tuple(f.name for f in fields(StepRecord))
_KNOWN = {"header": {f.name for f in fields(TraceHeader)}, "request": set(_REQUEST_FIELDS),
          "step": set(_STEP_FIELDS)}


# --- writing ----------------------------------------------------------------------------------

def header_line(header: TraceHeader) -> str:
    return _line({"kind": "header", **asdict(header)})


def config_line(t: float, version: int, config: dict[str, Any]) -> str:
    return _line({"kind": "config", "t": round(t, 6), "config_version": version,
                  "config": config})


def request_line(r: RequestRecord) -> str:
    d: dict[str, Any] = {"kind": "request"}
    for name in _REQUEST_FIELDS:       # a shallow dict: `asdict` deep-copies every list
        d[name] = getattr(r, name)
    for key in ("arrival", "finish", "first_token"):
        if d[key] is not None:
            d[key] = round(d[key], 6)
    return json.dumps(d, separators=(",", ":")) + "\n"


def step_line(s: StepRecord) -> str:
    """A step's line, formatted directly (there are many: a few microseconds each, against
    ~15 for a dict through `json.dumps`); times to 0.1 us; the JSON `parse_lines` reads."""
    period = "null" if s.period is None else f"{s.period:.7f}"
    native = ',"native":true' if s.native else ""      # absent: false (older traces too)
    return (f'{{"kind":"step","t":{s.t:.7f},"dur":{s.dur:.7f},"execute":{s.execute:.7f},'
            f'"prefill":{s.prefill},"decode":{s.decode},"reqs":{s.reqs},'
            f'"running":{s.running},"waiting":{s.waiting},"context":{s.context},'
            f'"prefill_attn":{s.prefill_attn},"new_reqs":{s.new_reqs},'
            f'"preempted":{s.preempted},"finished":{s.finished},"kv_used":{s.kv_used},'
            f'"period":{period}{native}}}\n')


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """The whole trace, in time order (requests by finish, steps by start)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(trace_lines(trace))


def trace_lines(trace: Trace) -> Iterator[str]:
    yield header_line(trace.header)
    for version, config in sorted(trace.configs.items()):
        if version != trace.header.config_version:
            yield config_line(trace.config_times.get(version, 0.0), version, config)
    timed = [(r.finish, 0, request_line(r)) for r in trace.requests]
    timed += [(s.t, 1, step_line(s)) for s in trace.steps]
    for _, _, line in sorted(timed, key=lambda x: (x[0], x[1])):
        yield line


def prompt_block_hashes(token_ids: list[int], block_size: int, *,
                        key: bytes = b"") -> list[str]:
    """Chained hashes of the prompt's full blocks: block i's hash covers every token up to
    the end of block i, so two prompts share their first k hashes exactly when they share
    their first k blocks' tokens. A one-way hash (BLAKE2b, 64 bits, over the ids as
    little-endian 4-byte integers); the engine keys it per trace (``key``), so its hashes
    compare only with each other: no one can test a guessed prompt against them."""
    data = array("I", token_ids)        # OverflowError for an id beyond 32 bits
    if data.itemsize != 4 or sys.byteorder != "little":     # rare platforms: byte by byte
        data = array("B", b"".join(t.to_bytes(4, "little") for t in token_ids))
    raw = memoryview(data).cast("B")
    width = 4 * block_size
    parent = b""
    out: list[str] = []
    for i in range(len(token_ids) // block_size):
        h = hashlib.blake2b(parent, digest_size=8, key=key)
        h.update(raw[i * width:(i + 1) * width])
        parent = h.digest()
        out.append(h.hexdigest())
    return out


# --- reading ----------------------------------------------------------------------------------

def read_trace(path: str | os.PathLike[str]) -> Trace:
    """A vconsole trace (JSON lines) or a public CSV trace, by the file's first bytes."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(1)
    except OSError as e:
        raise TraceError(f"cannot read {p}: {e.strerror or e}") from e
    if not head:
        raise TraceError(f"{p} is empty: no requests to replay")
    if head != b"{":
        return read_csv(p)
    return parse_lines(p.read_text(encoding="utf-8").splitlines(keepends=True), str(p))


def parse_lines(lines: Iterable[str], name: str = "trace") -> Trace:
    """The trace in ``lines`` (each ending in a newline but perhaps the last). Raises
    `TraceError` naming the line at fault."""
    trace: Trace | None = None
    last = 0
    for n, line in enumerate(lines, 1):
        last = n
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            whole = line.endswith("\n")
            raise TraceError(f"{name}: line {n} is not {'valid' if whole else 'whole'} JSON "
                             f"({'malformed' if whole else 'the file was cut short'}: "
                             f"{e.msg})") from e
        if not isinstance(obj, dict) or "kind" not in obj:
            raise TraceError(f"{name}: line {n} is not a trace record (no 'kind')")
        kind = obj.pop("kind")
        known = _KNOWN.get(kind)
        if known is not None:       # a newer writer's added fields: not ours to read
            obj = {k: v for k, v in obj.items() if k in known}
        try:
            if kind == "header":
                if trace is not None:
                    raise TraceError(f"{name}: a second header at line {n}")
                version = obj.get("version")
                if version != TRACE_VERSION:
                    raise TraceError(f"{name}: trace format version {version!r}; this "
                                     f"vconsole reads version {TRACE_VERSION}")
                trace = Trace(TraceHeader(**obj))
                trace.configs[trace.header.config_version] = trace.header.config
            elif trace is None:
                raise TraceError(f"{name}: line {n} comes before the header (not a vconsole "
                                 f"trace, or its start was cut off)")
            elif kind == "config":
                version = int(obj["config_version"])
                trace.configs[version] = dict(obj["config"])
                trace.config_times[version] = float(obj.get("t", 0.0))
            elif kind == "request":
                trace.requests.append(RequestRecord(**obj))
            elif kind == "step":
                trace.steps.append(StepRecord(**obj))
            else:
                raise TraceError(f"{name}: line {n}: unknown record kind {kind!r}")
        except TypeError as e:
            raise TraceError(f"{name}: line {n}: a {kind} record with the wrong fields "
                             f"({e})") from e
    if trace is None:
        raise TraceError(f"{name} holds no header{' (empty)' if last == 0 else ''}")
    if not trace.requests:
        raise TraceError(f"{name} holds no finished request: nothing to replay")
    trace.requests.sort(key=lambda r: r.arrival)
    trace.steps.sort(key=lambda s: s.t)
    return trace


# Column names of public traces: (arrival columns, prompt tokens, output tokens).
_CSV_PROMPT = ("PromptTokenCount", "ContextTokens", "num_prefill_tokens", "prompt_len")
_CSV_OUTPUT = ("CompletionTokenCount", "GeneratedTokens", "num_decode_tokens", "output_len")


def read_csv(path: str | os.PathLike[str]) -> Trace:
    """A public trace: Vidur's (``arrived_at`` seconds, ``num_prefill_tokens``,
    ``num_decode_tokens``) or Azure's (``TIMESTAMP`` or ``Date`` + ``Time``, and
    ``PromptTokenCount``/``ContextTokens``, ``CompletionTokenCount``/``GeneratedTokens``).
    Every prompt is its own (no shared prefix is known); outputs are exact (``ignore_eos``)."""
    p = Path(path)
    with p.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        prompt_col = next((c for c in _CSV_PROMPT if c in cols), None)
        output_col = next((c for c in _CSV_OUTPUT if c in cols), None)
        if prompt_col is None or output_col is None:
            raise TraceError(f"{p}: not a trace CSV: needs a prompt-length column (one of "
                             f"{', '.join(_CSV_PROMPT)}) and an output-length column (one of "
                             f"{', '.join(_CSV_OUTPUT)}); it has {', '.join(cols) or 'none'}")
        arrival = _csv_arrival(cols, p)
        rows = []
        for n, row in enumerate(reader, 2):
            try:
                t = arrival(row)
                prompt, output = int(row[prompt_col]), int(row[output_col])
            except (TypeError, ValueError) as e:
                raise TraceError(f"{p}: row {n}: {e}") from e
            if prompt < 1 or output < 1:
                continue          # nothing asked or nothing generated: nothing to replay
            rows.append((t, prompt, output))
    if not rows:
        raise TraceError(f"{p} holds no request with a prompt and an output")
    t0 = min(r[0] for r in rows)
    trace = Trace(TraceHeader(model=None, block_size=16, num_kv_blocks=None, source="csv"))
    for t, prompt, output in sorted(rows):
        trace.requests.append(RequestRecord(arrival=t - t0, finish=t - t0, prompt_len=prompt,
                                            output_len=output, max_tokens=output,
                                            ignore_eos=True))
    return trace


def _csv_arrival(cols: Sequence[str], p: Path):  # noqa: ANN202 - a small local parser
    if "arrived_at" in cols:
        return lambda row: float(row["arrived_at"])
    if "TIMESTAMP" in cols:
        return lambda row: _parse_time(row["TIMESTAMP"])
    if "Date" in cols and "Time" in cols:
        return lambda row: _parse_time(f"{row['Date']} {row['Time']}")
    raise TraceError(f"{p}: no arrival column (arrived_at, TIMESTAMP, or Date and Time)")


def _parse_time(text: str) -> float:
    """``2023-11-16 18:15:46.6805900`` (7 fraction digits, as Azure writes) to unix seconds."""
    text = text.strip()
    frac = 0.0
    if "." in text:
        text, digits = text.rsplit(".", 1)
        frac = float("0." + digits.rstrip("Z")) if digits.rstrip("Z") else 0.0
    return datetime.fromisoformat(text).timestamp() + frac


# --- replaying --------------------------------------------------------------------------------

def check_model(trace: Trace, model: str | None, block_size: int | None = None) -> str | None:
    """Why ``trace`` cannot describe an engine serving ``model`` (None when it can). A CSV
    trace names no model and fits any."""
    if trace.header.source == "csv" or model is None:
        return None
    if trace.header.model != model:
        return (f"the trace was recorded on model {trace.header.model!r}, not {model!r}: its "
                f"step costs and prompt lengths describe another model")
    return None


def synthetic_prompt(record: RequestRecord, index: int, block_size: int,
                     vocab_size: int) -> list[int]:
    """``record.prompt_len`` token ids whose full blocks share prefixes exactly as the
    recorded prompts did: block i's tokens are drawn from its chained hash (SHAKE-256 of the
    hash, 4 bytes a token), so equal hashes give equal tokens (and distinct hashes, almost
    surely, distinct ones). ``block_size`` is the trace's, the size the hashes cover. The
    tokens after the last hashed block are the request's own (drawn from ``index``). Ids stay
    clear of the low ids where tokenizers keep their special tokens."""
    lo = min(100, vocab_size // 4)
    span = vocab_size - lo
    out: list[int] = []
    for h in record.block_hashes:
        if len(out) + block_size > record.prompt_len:
            break
        out.extend(_draw(bytes.fromhex(h), block_size, lo, span))
    rest = record.prompt_len - len(out)
    if rest > 0:
        out.extend(_draw(f"request:{index}".encode(), rest, lo, span))
    return out


def _draw(key: bytes, n: int, lo: int, span: int) -> list[int]:
    words = array("I", hashlib.shake_256(key).digest(4 * n))
    return [lo + w % span for w in words]


def finished_normally(record: RequestRecord) -> bool:
    """A request that ran to its end (length or stop): what a replay can reproduce."""
    return record.finish_reason in ("length", "stop") and record.output_len > 0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between ranks, as numpy's default."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def request_record(req: Any, *, t0: float, finish: float, config_version: int,
                   block_hashes: list[str]) -> RequestRecord:
    """The record of a finished engine `Request` (read by attribute: the wire imports no
    engine code), times shifted to the trace's start ``t0``. The engine's trace and the
    what-if simulator both make their records here, so they are measured alike."""
    first = req.first_token_time
    sp = req.sampling
    return RequestRecord(
        arrival=req.arrival_time - t0, finish=finish - t0,
        first_token=None if first is None else first - t0,
        prompt_len=len(req.prompt_token_ids), output_len=len(req.output_token_ids),
        max_tokens=sp.max_tokens, block_hashes=block_hashes, ignore_eos=sp.ignore_eos,
        priority=req.priority,
        finish_reason=str(req.finish_reason) if req.finish_reason is not None else "error",
        num_preemptions=req.num_preemptions, num_cached_tokens=max(0, req.num_cached_tokens),
        config_version=config_version, itl_us=[round(g * 1e6) for g in req.token_gaps])


FIGURES = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
           "preemptions", "kv_usage_peak")


def figures(requests: list[RequestRecord], steps: list[StepRecord] | None = None,
            num_kv_blocks: int | None = None) -> dict[str, float | int | None]:
    """What a what-if compares, from finished requests (and steps, for the KV peak):
    ``output_tok_s`` is output tokens over first arrival -> last finish, as `vconsole load`
    counts its ``tok_per_s``; TTFT and e2e from arrival; ITL over every gap of every request;
    ``preemptions`` summed over requests; ``kv_usage_peak`` the most blocks in use at a step
    over the pool (None without steps or a pool size)."""
    if not requests:
        return dict.fromkeys(FIGURES)
    span = max(r.finish for r in requests) - min(r.arrival for r in requests)
    ttft = [r.first_token - r.arrival for r in requests if r.first_token is not None]
    itl = [g / 1e6 for r in requests for g in r.itl_us]
    e2e = [r.finish - r.arrival for r in requests]
    peak = None
    if steps and num_kv_blocks:
        peak = round(max(s.kv_used for s in steps) / num_kv_blocks, 4)
    return {
        "output_tok_s": round(sum(r.output_len for r in requests) / span, 3) if span > 0
        else None,
        "ttft_p50_s": _round(percentile(ttft, 50)), "ttft_p99_s": _round(percentile(ttft, 99)),
        "itl_p50_s": _round(percentile(itl, 50)), "itl_p99_s": _round(percentile(itl, 99)),
        "e2e_p50_s": _round(percentile(e2e, 50)),
        "preemptions": sum(r.num_preemptions for r in requests),
        "kv_usage_peak": peak,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
