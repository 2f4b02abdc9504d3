"""`vconsole bench structured`: requests under a JSON schema against the same requests
unconstrained, on a real model (``smollm2`` by default), as JSON.

**Workload.** ``--num-requests`` (64) chat prompts that ask for an object, cycling six schemas
(`SCHEMAS`: nested objects, arrays of objects, enums, required fields, string patterns; every
string, array and number bounded), the schema in the system prompt as a deployment would
write it; greedy, ``max_tokens`` 256 (above any schema's longest instance). Closed loop at each
``--concurrency`` level (1 and 32): that many requests in flight, a finished one letting the
next in.

**The two sides.** Constrained: each request carries ``structured = {"kind": "json",
"value": schema}`` (no ``ignore_eos``: the engine refuses it with a grammar); it stops where
the grammar ends. Unconstrained: the same prompts with ``max_tokens`` set to the length of the
constrained output of the same request, and ``ignore_eos``, so both sides compute exactly the
same tokens (the engine runs without its prefix cache, else the second side would find the
first side's prompts cached) and the ratio of their output tok/s is the cost of the grammar alone (a small
model left free talks to max_tokens, and a ratio over different lengths would measure the
lengths). The first round runs constrained first (its lengths are the twins'); with
``--rounds`` > 1 later rounds alternate the order, and tok/s is the rounds' median.

**Figures per level.** ``validity``: each constrained output through ``json.loads`` and
``jsonschema.validate``, the count of failures by kind and an example of each;
``constrained`` / ``unconstrained``: output tokens, elapsed, tok/s, finish reasons, the
engine's own step records of the run (its request trace: all steps and their summed time
``busy_s``, and the decode-only steps
at the run's steady batch, at least 3/4 of its widest, whose median is one step's cost) and
``structured_share_of_step``: the ``structured`` phase (bitmask filled and applied, matchers
advanced) over the busy time of the run's steps, from the engine's ``step`` telemetry;
``ratio`` (constrained tok/s over unconstrained: goal ≥ 0.95 at 32), ``steady_step_ratio``
(the steady steps' medians: the same question asked of the steps); ``engine_compiles``: the
engine's compile counters over the constrained run (compiles, cache hits, errors, mean ms).

**Compile time per schema** (``compile``): the engine's own `GrammarCompiler` in this process
after the engine stopped: cold (a fresh compiler, tokenizer built: what a new spec costs) and
cached (the same spec again: the cache's future and the matcher copy a request gets), and the
probe's schema below.

**Compiles beside the busy loop** (``compile_probe``): with ``top - 1`` rows decoding
(unconstrained, ``ignore_eos``), probe requests are sent one at a time, `GAP_STEPS` background
steps apart, each under a schema the engine has never seen: ``typical`` (6; 2 when the workload
is under 32 requests), one of the workload's schemas with an extra optional property named
after the probe (`typical_schema`: a compile of about a millisecond), then ``heavy`` (half as
many), a 300-property schema (`heavy_schema`: tens of ms). From the request trace, the
background's decode-only steps that ran while a probe's grammar compiled (from its submit to
the step that admitted it) are set against the window's steps that no probe touched, at the
same batch: their medians' ratio, and how many compile-window steps were longer than the
others' p90 and than their max (goal: no typical compile's step longer than the max).
``first_masks``: the steps after a probe's admission, where its first masks run on the busy
loop.

**Paired steps** (``paired_steps``, at the top concurrency, after the engine stopped): the
same workload on two cores in this process stepped in turn, constrained and unconstrained, the
same batch at every step (`structured_paired`): the grammar's cost per step with the machine's
drift cancelled, and the throughput ratio it implies (goal ≥ 0.95).

The machine's load average at the start and end is in the JSON: on shared cores the tok/s of
two runs swing by more than the goal's 5%, so read the steady step ratio, the structured
share and the paired steps beside the ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    """A JSON schema of the workload, a prompt that asks for it, and one valid instance (the
    backend measurement walks the instance's tokens; the tests validate it)."""

    name: str
    schema: dict[str, Any]
    prompt: str
    example: dict[str, Any]

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema, separators=(",", ":"))


_NAME = {"type": "string", "minLength": 1, "maxLength": 24}

# Every string, array and number is bounded, so a small model under the grammar always reaches
# the closing brace within the bench's max_tokens.
SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "person",
        {"type": "object",
         "properties": {"name": _NAME,
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        "email": {"type": "string",
                                  "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"}},
         "required": ["name", "age", "email"], "additionalProperties": False},
        "Describe a person as a JSON object with name, age and email.",
        {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org"}),
    SchemaCase(
        "address",
        {"type": "object",
         "properties": {"name": _NAME,
                        "address": {"type": "object",
                                    "properties": {"street": {"type": "string", "maxLength": 32},
                                                   "city": _NAME,
                                                   "zip": {"type": "string",
                                                           "pattern": "^[0-9]{5}$"}},
                                    "required": ["street", "city", "zip"],
                                    "additionalProperties": False},
                        "country": {"enum": ["US", "FR", "DE", "JP"]}},
         "required": ["name", "address", "country"], "additionalProperties": False},
        "Give a customer's mailing address as a JSON object.",
        {"name": "Bob", "address": {"street": "12 Elm St", "city": "Springfield",
                                    "zip": "12345"}, "country": "US"}),
    SchemaCase(
        "order",
        {"type": "object",
         "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object",
                                            "properties": {
                                                "sku": {"type": "string",
                                                        "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                                "qty": {"type": "integer", "minimum": 1,
                                                        "maximum": 9}},
                                            "required": ["sku", "qty"],
                                            "additionalProperties": False}},
                        "status": {"enum": ["pending", "shipped", "delivered"]}},
         "required": ["order_id", "items", "status"], "additionalProperties": False},
        "Write a shop order as a JSON object with an id, its items and a status.",
        {"order_id": 1042, "items": [{"sku": "ABC-1234", "qty": 2},
                                     {"sku": "XYZ-0001", "qty": 1}], "status": "shipped"}),
    SchemaCase(
        "event",
        {"type": "object",
         "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 40},
                        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                        "tags": {"type": "array", "maxItems": 3,
                                 "items": {"type": "string", "maxLength": 12}},
                        "priority": {"enum": ["low", "medium", "high"]}},
         "required": ["title", "date", "priority"], "additionalProperties": False},
        "Describe a calendar event as a JSON object with a title, date, tags and priority.",
        {"title": "Team offsite", "date": "2026-03-14", "tags": ["work", "travel"],
         "priority": "high"}),
    SchemaCase(
        "product",
        {"type": "object",
         "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "name": _NAME,
                        "in_stock": {"type": "boolean"},
                        "dimensions": {"type": "object",
                                       "properties": {
                                           "width": {"type": "integer", "minimum": 1,
                                                     "maximum": 500},
                                           "height": {"type": "integer", "minimum": 1,
                                                      "maximum": 500}},
                                       "required": ["width", "height"],
                                       "additionalProperties": False}},
         "required": ["id", "name", "in_stock", "dimensions"], "additionalProperties": False},
        "Describe a product in a catalogue as a JSON object.",
        {"id": 77, "name": "Desk lamp", "in_stock": True,
         "dimensions": {"width": 20, "height": 45}}),
    SchemaCase(
        "review",
        {"type": "object",
         "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                        "summary": {"type": "string", "maxLength": 60},
                        "recommend": {"type": "boolean"}},
         "required": ["sentiment", "stars", "summary", "recommend"],
         "additionalProperties": False},
        "Summarise a product review as a JSON object with sentiment, stars and a summary.",
        {"sentiment": "positive", "stars": 4, "summary": "Works well, a bit loud.",
         "recommend": True}),
)

# The backend measurement's two non-JSON specs (the engine's ``regex`` and ``choice`` kinds).
REGEX_SPEC = ("regex", "\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}", "(555) 123-4567")
CHOICE_SPEC = ("choice", json.dumps(["positive", "negative", "neutral"]), "neutral")


MAX_TOKENS = 256          # above any schema's longest instance, even at a byte per token
SYSTEM = "You reply with one JSON object and nothing else. It follows this JSON schema: "
Log = Callable[[str], None] | None


@dataclass
class Job:
    """One request of the workload: its prompt, its case and, when constrained, its spec."""

    index: int
    case: SchemaCase
    prompt_ids: list[int]


@dataclass
class Done:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    error: str | None
    submitted: float
    finished: float


def workload(renderer: Any, num: int) -> list[Job]:
    """``num`` chat prompts, cycling the schemas; each asks for its object, the schema in the
    system prompt (as a deployment would write it)."""
    from vconsole.tools.prompts import ChatPrompt

    jobs = []
    for i in range(num):
        case = SCHEMAS[i % len(SCHEMAS)]
        prompt = ChatPrompt(SYSTEM + case.schema_text, f"{case.prompt} Example {i + 1}.")
        jobs.append(Job(i, case, renderer.ids(prompt)))
    return jobs


def run_jobs(endpoints: dict[str, str], jobs: list[Job], concurrency: int, *,
             constrained: bool, max_tokens: list[int], ignore_eos: bool = False,
             timeout_s: float = 1800.0) -> tuple[list[Done], float]:
    """The jobs closed-loop at ``concurrency`` in flight, greedy; each finished request lets
    the next in. Returns every request's outcome (in job order) and the elapsed seconds from
    the first submit to the last final output."""
    from vconsole.engine.client.client import Completion, EngineClient

    with EngineClient(endpoints["input"], endpoints["output"], timeout_s=60) as client:
        queue = list(reversed(jobs))
        live: dict[str, tuple[Job, Completion, float]] = {}
        done: dict[int, Done] = {}

        def submit() -> None:
            job = queue.pop()
            extra: dict[str, Any] = {}
            if constrained:
                extra["structured"] = {"kind": "json", "value": job.case.schema_text}
            if ignore_eos:
                extra["ignore_eos"] = True
            rid = client.submit(prompt_token_ids=job.prompt_ids,
                                max_tokens=max_tokens[job.index], temperature=0.0, **extra)
            live[rid] = (job, Completion(rid), time.perf_counter())

        t0 = time.perf_counter()
        while queue and len(live) < concurrency:
            submit()
        for out in client.outputs(timeout_s):
            job, comp, sent = live[out.request_id]
            comp.add(out)
            if out.finished:
                del live[out.request_id]
                done[job.index] = Done(job.index, comp.output_token_ids, comp.finish_reason,
                                       comp.error, sent, time.perf_counter())
                if queue:
                    submit()
        elapsed = time.perf_counter() - t0
    return [done[j.index] for j in jobs], elapsed


def check_output(text: str, finish_reason: str | None, error: str | None,
                 schema: dict[str, Any]) -> str | None:
    """Why the output is not a valid instance of ``schema`` (None when it is)."""
    import jsonschema

    if error:
        return f"error: {error}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        cut = " (cut at max_tokens)" if finish_reason == "length" else ""
        return f"not JSON{cut}: {e.msg}"
    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        return f"schema: {where}: {e.message[:120]}"
    return None


def validity(tokenizer: Any, jobs: list[Job], done: list[Done]) -> dict[str, Any]:
    reasons: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for job, d in zip(jobs, done, strict=True):
        text = tokenizer.decode(d.token_ids, skip_special_tokens=True)
        why = check_output(text, d.finish_reason, d.error, job.case.schema)
        if why is not None:
            kind = why.split(":", 1)[0]
            reasons[kind] += 1
            examples.setdefault(kind, f"{job.case.name}: {why}; output {text[:160]!r}")
    n = len(done)
    return {"requests": n, "valid": n - sum(reasons.values()),
            "valid_rate": round((n - sum(reasons.values())) / n, 4) if n else None,
            "failures": dict(reasons), "failure_examples": examples}


def _figures(done: list[Done], elapsed: float) -> dict[str, Any]:
    tokens = sum(len(d.token_ids) for d in done)
    return {"output_tokens": tokens, "elapsed_s": round(elapsed, 3),
            "tok_per_s": round(tokens / elapsed, 2) if elapsed else None,
            "finish_reasons": dict(Counter(str(d.finish_reason) for d in done))}


# --- the engine's step records ------------------------------------------------------------

STEP_KEYS = {"kind", "t", "dur", "execute", "prefill", "decode", "reqs", "running", "waiting",
             "context", "prefill_attn", "new_reqs", "preempted", "finished", "kv_used",
             "period"}


def read_steps(path: Path) -> tuple[float, list[dict[str, Any]]]:
    """The trace's ``started_unix`` and its step lines as dicts (every key kept, the engine's
    own additions too: a structured-output phase, if it records one)."""
    started, steps = 0.0, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            obj = json.loads(line)
            if obj.get("kind") == "header":
                started = float(obj.get("started_unix", 0.0))
            elif obj.get("kind") == "step":
                steps.append(obj)
    return started, steps


def step_figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's steps: how many, their median, and the decode-only steps at the run's steady
    batch (at least 3/4 of its widest decode), whose median is the cost of one step of
    ``decode`` rows; with the structured phase's share of the step when the engine records
    one (any numeric key the trace adds beside the known ones)."""
    if not steps:
        return {"steps": 0}
    widest = max(s["decode"] for s in steps)
    steady = [s for s in steps if s["prefill"] == 0 and s["decode"] >= 0.75 * widest]
    out: dict[str, Any] = {
        "steps": len(steps), "busy_s": round(sum(s["dur"] for s in steps), 3),
        "step_ms_median": round(statistics.median(s["dur"] for s in steps)
                                                      * 1e3, 3),
        "steady_steps": len(steady), "steady_rows_median": statistics.median(
            s["decode"] for s in steady) if steady else None,
        "steady_step_ms_median": round(statistics.median(s["dur"] for s in steady) * 1e3, 3)
        if steady else None}
    extra = sorted({k for s in steps for k, v in s.items() if k not in STEP_KEYS
                    and isinstance(v, int | float) and not isinstance(v, bool)})
    total = sum(s["dur"] for s in steps)
    for k in extra:
        share = sum(float(s.get(k) or 0) for s in steps) / total if total else None
        out[f"{k}_share_of_step"] = round(share, 4) if share is not None else None
    return out


def _in_window(steps: list[dict[str, Any]], started: float, t0: float,
               t1: float) -> list[dict[str, Any]]:
    lo, hi = t0 - started, t1 - started
    return [s for s in steps if lo <= s["t"] <= hi]


# --- the engine's telemetry: the structured phase and the compile counters ----------------

COMPILE_COUNTERS = ("structured_compiles_total", "structured_compile_cache_hits_total",
                    "structured_compile_errors_total", "structured_compile_seconds_total")


class Phases:
    """The engine's ``step`` telemetry summed per label (the bench names what runs), and its
    latest ``sched`` compile counters, from a listener thread."""

    def __init__(self, endpoint: str) -> None:
        import threading

        from vconsole.telemetry.listener import TelemetryListener

        self.label: str | None = None
        self.sums: dict[str, dict[str, float]] = {}
        self.counters: dict[str, float] = {}
        self._lock = threading.Lock()
        self._listener = TelemetryListener(endpoint, self._on, topics=("step", "sched"))

    def _on(self, msg: Any) -> None:
        p = msg.payload
        with self._lock:
            if msg.topic == "sched":
                self.counters = {k: float(p[k]) for k in COMPILE_COUNTERS if k in p}
            elif self.label is not None:
                acc = self.sums.setdefault(self.label, {})
                acc["busy_s"] = acc.get("busy_s", 0.0) + float(p.get("busy_s") or 0.0)
                acc["steps"] = acc.get("steps", 0.0) + float(p.get("steps") or 0)
                for k, v in (p.get("phase_s") or {}).items():
                    acc[k] = acc.get(k, 0.0) + float(v)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)

    def share(self, label: str, phase: str = "structured") -> float | None:
        """``phase``'s seconds over the busy seconds of the steps run under ``label`` (None
        when the engine reports no such phase)."""
        with self._lock:
            acc = self.sums.get(label, {})
            if phase not in acc or not acc.get("busy_s"):
                return None
            return round(acc[phase] / acc["busy_s"], 4)

    def close(self) -> None:
        self._listener.close(None)


def compile_figures(model_path: str, reps: int = 3) -> dict[str, Any]:
    """Each schema through the engine's own `GrammarCompiler`, in this process: **cold** (a
    fresh compiler, the tokenizer already built: the compile a new spec costs, median of
    ``reps``) and **cached** (the same spec again: the cache's future plus the copy of its
    matcher a request gets, median of 5), in ms."""
    from transformers import AutoTokenizer

    from vconsole.engine.request import StructuredSpec
    from vconsole.engine.structured.compiler import GrammarCompiler, build_tokenizer

    hf = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    gen = Path(model_path) / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos_ids = tuple(eos if isinstance(eos, list) else [eos if eos is not None
                                                       else hf.eos_token_id])
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(hf, vocab, eos_ids)
    tokenizer_s = time.perf_counter() - t0
    out: dict[str, Any] = {}
    named = [(c.name, c.schema_text) for c in SCHEMAS] + [("probe", heavy_schema(0))]
    for name, text in named:
        spec = StructuredSpec("json", text)
        cold, wall, cached = [], [], []
        for rep in range(reps):
            compiler = GrammarCompiler(lambda: tokenizer)
            try:
                _ = compiler.vocab_size             # the tokenizer is ready: compiles only
                t0 = time.perf_counter()
                grammar = compiler.submit(spec)[0].result()
                wall.append(time.perf_counter() - t0)
                if grammar.error or grammar.matcher is None:
                    raise ValueError(f"{name}: {grammar.error}")
                cold.append(grammar.compile_s)
                for _ in range(5 if rep == 0 else 0):
                    t0 = time.perf_counter()
                    fut, hit = compiler.submit(spec)
                    matcher = fut.result().matcher
                    assert hit and matcher is not None
                    matcher.deep_copy()
                    cached.append(time.perf_counter() - t0)
            finally:
                compiler.close()
        out[name] = {"cold_ms": round(statistics.median(cold) * 1e3, 3),
                          "cold_submit_to_ready_ms": round(statistics.median(wall) * 1e3, 3),
                          "cached_ms": round(statistics.median(cached) * 1e3, 4)}
    return {"tokenizer_ms": round(tokenizer_s * 1e3, 1), "schemas": out}


# --- compiles beside the busy loop --------------------------------------------------------

PROBE_PROMPT = "Fill in the form as one JSON object."
PROBE_TOKENS = 2          # the probe's first mask runs in its prefill step, its second after
BACKGROUND_TOKENS = 800   # outlasts the probes (the background is aborted when they are done)
GAP_STEPS = 6             # background steps between two probes (the "other" steps)


def heavy_schema(tag: int, fields: int = 150) -> str:
    """A schema that takes tens of ms to compile (``fields`` string properties with patterns
    and as many enums, all required); ``tag`` goes into every name, so each probe misses the
    engine's grammar cache."""
    props: dict[str, Any] = {}
    for i in range(fields):
        props[f"f{tag}_{i}"] = {"type": "string",
                                "pattern": f"^[a-z]{{2,8}}-[0-9]{{{1 + i % 4}}}(x|y|z{i})$"}
        props[f"e{tag}_{i}"] = {"enum": [f"v{j}_{i}" for j in range(12)]}
    return json.dumps({"type": "object", "properties": props, "required": list(props),
                       "additionalProperties": False})


def typical_schema(tag: int) -> str:
    """One of `SCHEMAS` with an optional property named after ``tag``: a schema of the
    workload's size that the engine's grammar cache has never seen."""
    case = SCHEMAS[tag % len(SCHEMAS)]
    schema = json.loads(case.schema_text)
    schema["properties"][f"note_{tag}"] = {"type": "string", "maxLength": 8}
    return json.dumps(schema, separators=(",", ":"))


def compile_probe(endpoints: dict[str, str], renderer: Any, background: list[Job],
                  schemas: dict[str, list[str]], max_model_len: int
                  ) -> tuple[dict[str, list[tuple[float, float]]], float, float]:
    """While ``background`` decodes (unconstrained, ``ignore_eos``), send one request per
    schema of ``schemas`` (by group), one at a time, `GAP_STEPS` background steps apart, and
    wait for each to finish. Returns each group's (submit, finish) wall-clock times and the
    window in which the background was decoding."""
    from vconsole.engine.client.client import EngineClient
    from vconsole.tools.prompts import ChatPrompt

    probe_ids = renderer.ids(ChatPrompt(None, PROBE_PROMPT))
    marks: dict[str, list[tuple[float, float]]] = {g: [] for g in schemas}
    with EngineClient(endpoints["input"], endpoints["output"], timeout_s=60) as client:
        bg = [client.submit(prompt_token_ids=j.prompt_ids, ignore_eos=True, temperature=0.0,
                            max_tokens=min(BACKGROUND_TOKENS,
                                           max_model_len - len(j.prompt_ids) - 1))
              for j in background]
        first = set()
        for out in client.outputs(600):          # every background row past its prefill
            if out.new_token_ids:
                first.add(out.request_id)
            if len(first) == len(bg):
                break

        def steps(n: int) -> None:               # n outputs of one background row
            for i, _out in enumerate(client.stream(bg[0], 600)):
                if i + 1 >= n:
                    return

        t_bg = time.time()
        for group, texts in schemas.items():
            for text in texts:
                steps(GAP_STEPS)
                sent = time.time()
                rid = client.submit(prompt_token_ids=probe_ids, max_tokens=PROBE_TOKENS,
                                    temperature=0.0, structured={"kind": "json", "value": text})
                for out in client.stream(rid, 600):
                    if out.finished:
                        if out.error:
                            raise RuntimeError(f"compile probe failed: {out.error}")
                        break
                marks[group].append((sent, time.time()))
        steps(GAP_STEPS)
        t_end = time.time()
        client.abort(bg)
        client.gather(bg, 60)
    return marks, t_bg, t_end


def _classify(window: list[dict[str, Any]], started: float, marks: list[tuple[float, float]]
              ) -> tuple[list[float], list[float], set[float]]:
    """The decode-only steps that ran while each probe's grammar compiled (from its submit to
    the step that admitted it: ``new_reqs`` > 0), those after it (its first masks, to its
    finish), and the start times of every step a probe touched (prefills included)."""
    compiling: list[float] = []
    first_masks: list[float] = []
    used: set[float] = set()
    for sent, done in marks:
        lo, hi = sent - started, done - started
        admitted = next((s for s in window if s["t"] + s["dur"] >= lo and s["new_reqs"] > 0),
                        None)
        cut = admitted["t"] if admitted else hi
        for s in window:
            if s is admitted or (s["prefill"] and lo <= s["t"] <= hi):
                used.add(s["t"])
            elif s["t"] + s["dur"] >= lo and s["t"] < cut:   # ran while the grammar compiled
                compiling.append(s["dur"])
                used.add(s["t"])
            elif cut < s["t"] <= hi:
                first_masks.append(s["dur"])
                used.add(s["t"])
    return compiling, first_masks, used


def _ms(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3) if xs else None


def stall_figures(steps: list[dict[str, Any]], started: float,
                  marks: dict[str, list[tuple[float, float]]], t_bg: float,
                  t_end: float) -> dict[str, Any]:
    """Per probe group: its compile-window and first-mask steps (`_classify`) against the
    window's other decode-only steps at the background's batch (no probe in them)."""
    window = _in_window(steps, started, t_bg, t_end)
    groups = {g: _classify(window, started, m) for g, m in marks.items()}
    used = set().union(*(u for _c, _f, u in groups.values())) if groups else set()
    rows = statistics.median(s["decode"] for s in window) if window else 0
    other = [s["dur"] for s in window if s["t"] not in used and s["prefill"] == 0
             and s["decode"] >= rows - 1]
    med, p90, mx = _ms(other, 0.5), _ms(other, 0.9), _ms(other, 1.0)
    out: dict[str, Any] = {
        "background_rows": rows, "other_steps": len(other),
        "other_ms": {"median": med, "p90": p90, "max": mx}}
    for g, (compiling, first_masks, _u) in groups.items():
        cmed = _ms(compiling, 0.5)
        out[g] = {
            "probes": len(marks[g]), "steps_while_compiling": len(compiling),
            "while_compiling_ms": {"median": cmed, "max": _ms(compiling, 1.0)},
            "steps_first_masks": len(first_masks),
            "first_masks_ms": {"median": _ms(first_masks, 0.5), "max": _ms(first_masks, 1.0)},
            "while_compiling_over_other_median": round(cmed / med, 3) if cmed and med
            else None,
            "while_compiling_over_other_p90": sum(1 for d in compiling if p90 is not None
                                                  and d * 1e3 > p90),
            "while_compiling_over_other_max": sum(1 for d in compiling if mx is not None
                                                  and d * 1e3 > mx)}
    return out


# --- the bench ----------------------------------------------------------------------------

def structured_bench(model: str = "smollm2", num_requests: int = 64,
                     concurrencies: list[int] | None = None, rounds: int = 1,
                     max_tokens: int = MAX_TOKENS, probes: int | None = None,
                     log: Log = None) -> dict[str, Any]:
    from vconsole.engine.launch.engine_process import EngineProcess
    from vconsole.tools.bench.structured_paired import paired_steps
    from vconsole.tools.prompts import load_renderer

    say = log or (lambda _m: None)
    levels = concurrencies or [1, 32]
    if probes is None:
        probes = 6 if num_requests >= 32 else 2
    work = Path(tempfile.mkdtemp(prefix="vconsole-bench-structured-"))
    trace_path = work / "trace.jsonl"
    windows: list[tuple[str, float, float]] = []
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    valid: dict[str, dict[str, Any]] = {}
    compiles: dict[str, dict[str, float]] = {}
    shares: dict[str, dict[str, float | None]] = {}
    load = [os.getloadavg()[0]]
    probe_marks: dict[str, list[tuple[float, float]]] = {}
    t_bg = t_end = 0.0
    say(f"starting an engine ({model}) ...")
    # No prefix cache: the side that runs second would find the first side's prompts cached.
    args = ["--model", model, "--max-num-seqs", str(max(64, *levels)), "--no-prefix-caching",
            "--request-trace", str(trace_path)]
    try:
        with EngineProcess(args) as engine:
            engine.start(timeout_s=300)
            model_path = engine.ready["model_path"]
            renderer = load_renderer(model_path)
            jobs = workload(renderer, num_requests)
            caps = [max_tokens] * len(jobs)
            phases = Phases(engine.endpoints["telemetry"])
            try:
                run_jobs(engine.endpoints, jobs[:2], 2, constrained=False,
                         max_tokens=[4] * 2)                         # warm-up
                for c in levels:
                    key = str(c)
                    runs[key] = {"constrained": [], "unconstrained": []}
                    lengths: list[int] | None = None
                    for r in range(rounds):
                        # The constrained run goes first in the first round: its output
                        # lengths are the unconstrained twins' (with ignore_eos), so both
                        # sides compute the same tokens; later rounds alternate.
                        order = ("constrained", "unconstrained") if r % 2 == 0 \
                            else ("unconstrained", "constrained")
                        for side in order:
                            label = f"{key}/{side}"
                            before = phases.snapshot()
                            phases.label = label
                            w0 = time.time()
                            if side == "constrained":
                                done, elapsed = run_jobs(engine.endpoints, jobs, c,
                                                         constrained=True, max_tokens=caps)
                            else:
                                assert lengths is not None
                                done, elapsed = run_jobs(engine.endpoints, jobs, c,
                                                         constrained=False, max_tokens=lengths,
                                                         ignore_eos=True)
                            windows.append((label, w0, time.time()))
                            time.sleep(1.2)       # the step telemetry of the run's last steps
                            phases.label = None
                            if side == "constrained" and lengths is None:
                                lengths = [max(1, len(d.token_ids)) for d in done]
                                valid[key] = validity(renderer.tokenizer, jobs, done)
                                after = phases.snapshot()
                                compiles[key] = {k: after.get(k, 0.0) - before.get(k, 0.0)
                                                 for k in COMPILE_COUNTERS}
                            runs[key][side].append(_figures(done, elapsed))
                            say(f"concurrency {c} round {r + 1} {side}: "
                                f"{runs[key][side][-1]['tok_per_s']} tok/s")
                    shares[key] = {side: phases.share(f"{key}/{side}")
                                   for side in ("constrained", "unconstrained")}
                if probes:
                    rows = max(1, max(levels) - 1)
                    say(f"compile probe: {probes} + {max(1, probes // 2)} cold compiles "
                        f"beside {rows} decoding rows")
                    background = [jobs[i % len(jobs)] for i in range(rows)]
                    tag = int(time.time())
                    groups = {"typical": [typical_schema(tag + i) for i in range(probes)],
                              "heavy": [heavy_schema(tag + i)
                                        for i in range(max(1, probes // 2))]}
                    probe_marks, t_bg, t_end = compile_probe(
                        engine.endpoints, renderer, background, groups,
                        int(engine.ready.get("max_model_len") or 2048))
            finally:
                phases.close()
            load.append(os.getloadavg()[0])
        say("compile times in this process ...")
        compile_times = compile_figures(model_path)
        paired = paired_steps(model_path, jobs, levels[-1], say) if levels[-1] > 1 else None
        started, steps = read_steps(trace_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_levels: dict[str, Any] = {}
    for key, sides in runs.items():
        level: dict[str, Any] = {"validity": valid[key]}
        for side, rs in sides.items():
            level[side] = {**rs[0], "tok_per_s": statistics.median(x["tok_per_s"] for x in rs),
                           "tok_per_s_rounds": [x["tok_per_s"] for x in rs]}
            side_steps = [s for name, w0, w1 in windows if name == f"{key}/{side}"
                          for s in _in_window(steps, started, w0, w1)]
            level[side]["steps"] = step_figures(side_steps)
            level[side]["structured_share_of_step"] = shares[key][side]
        u, k = level["unconstrained"], level["constrained"]
        level["ratio"] = round(k["tok_per_s"] / u["tok_per_s"], 3) if u["tok_per_s"] else None
        us, ks = u["steps"].get("steady_step_ms_median"), k["steps"].get("steady_step_ms_median")
        level["steady_step_ratio"] = round(ks / us, 3) if us and ks else None
        counts = compiles[key]
        n = counts.get("structured_compiles_total", 0.0)
        level["engine_compiles"] = {
            "compiles": int(n),
            "cache_hits": int(counts.get("structured_compile_cache_hits_total", 0)),
            "errors": int(counts.get("structured_compile_errors_total", 0)),
            "compile_ms_mean": round(counts["structured_compile_seconds_total"] / n * 1e3, 3)
            if n and "structured_compile_seconds_total" in counts else None}
        out_levels[key] = level
    stalls = stall_figures(steps, started, probe_marks, t_bg, t_end) if probes else None
    top = str(levels[-1])
    return {
        "model": model, "num_requests": num_requests, "max_tokens": max_tokens,
        "rounds": rounds, "schemas": [c.name for c in SCHEMAS], "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in load],
        "concurrency": out_levels,
        "valid_rate": min(v["validity"]["valid_rate"] for v in out_levels.values()),
        "ratio_at_top": out_levels[top]["ratio"],
        "steady_step_ratio_at_top": out_levels[top]["steady_step_ratio"],
        "paired_steps": paired,
        "compile": compile_times,
        "compile_probe": stalls,
        "goals": {"valid_rate": "== 1.0", "ratio_at_top": ">= 0.95",
                  "paired_steps.throughput_ratio": ">= 0.95",
                  "compile_probe.typical.while_compiling_over_other_max": "== 0"},
    }
