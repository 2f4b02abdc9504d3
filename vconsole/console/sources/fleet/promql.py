"""The PromQL the fleet asks of Prometheus (`vconsole.console.sources.fleet.prometheus_query`):
one expression per figure, every kind the fleet knows at once, one result series per
``(instance, engine)``.

Each figure lists its series per kind, with the names each kind's own code gives them (the
table in docs/fleet.md): ``vllm:*`` (vLLM, and our engine, which also exports ``vconsole:*``),
``sglang:*``, ``llamacpp:*``. A kind that has no such series (llama.cpp's latency) is simply
absent from the result. Rates are ``rate(...[1m])``; percentiles are ``histogram_quantile``
of bucket rates summed ``by (instance, engine, le)`` for a row and ``by (le)`` for the fleet.

``selector`` is the user's ``--selector`` (``{job="vllm"}``) as bare matchers
(``job="vllm"``), added to every series' own; "" selects everything Prometheus holds.
"""

from __future__ import annotations

import re

RANGE = "1m"
BY = "instance, engine"
ENGINE_UP = "vconsole:engine_up"     # only our engine exports it: the kind is "vconsole"
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs",
           "llamacpp:requests_processing")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
KV_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
GENERATION = ("vllm:generation_tokens_total", "sglang:generation_tokens_total",
              "llamacpp:tokens_predicted_total")
PREEMPTIONS = ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total")
# prefix hit rate: (hits, what they are a share of)
PREFIX_HIT = (("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
              ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
              ("llamacpp:prompt_tokens_cached_total",
               "llamacpp:prompt_tokens_cached_total + llamacpp:prompt_tokens_total"))
HISTOGRAMS = {"ttft_s": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
              "itl_s": ("vllm:inter_token_latency_seconds", "sglang:inter_token_latency_seconds")}
KIND_OF_PREFIX = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama-cpp"}
QUANTILES = (("ttft_s", 0.5), ("ttft_s", 0.99), ("itl_s", 0.99))

_SELECTOR = re.compile(r"^\s*\{?(.*?)\}?\s*$", re.S)


class SelectorError(ValueError):
    """A ``--selector`` that is not a set of label matchers."""


def matchers(selector: str | None) -> str:
    """``{job="x", zone=~"eu.*"}`` (or the same without braces) → ``job="x", zone=~"eu.*"``.
    A metric name in it is refused: the fleet chooses the series, the selector only narrows."""
    if not selector or not selector.strip():
        return ""
    text = selector.strip()
    if text.startswith("{") != text.endswith("}"):
        raise SelectorError(f"--selector {selector!r}: unbalanced braces (e.g. '{{job=\"vllm\"}}')")
    m = _SELECTOR.match(text)
    inner = (m.group(1) if m else text).strip().rstrip(",").strip()
    if not inner:
        return ""
    if "__name__" in inner or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\s*(=~|!~|!=|=)", inner):
        raise SelectorError(f"--selector {selector!r}: label matchers only, e.g. "
                            "'{job=\"vllm\", zone=~\"eu.*\"}'")
    return inner


def series(name: str, sel: str, extra: str = "") -> str:
    """``name{sel, extra}`` (no braces when there is nothing in them)."""
    inside = ", ".join(x for x in (sel, extra) if x)
    return f"{name}{{{inside}}}" if inside else name


def any_of(names: tuple[str, ...], sel: str, extra: str = "") -> str:
    """Every series of any of ``names``, in one selector."""
    alts = "|".join(re.escape(n) for n in names)
    inside = ", ".join(x for x in (f"__name__=~`{alts}`", sel, extra) if x)
    return f"{{{inside}}}"


def _rate(name: str, sel: str, extra: str = "") -> str:
    return f"rate({series(name, sel, extra)}[{RANGE}])"


def _sum_rate(names: tuple[str, ...], sel: str, by: str = BY, extra: str = "") -> str:
    return " or ".join(f"sum by ({by}) ({_rate(n, sel, extra)})" for n in names)


def inventory(sel: str) -> str:
    """One series per engine and kind: ``__name__`` says the kind, ``model_name`` the model."""
    return f"group by ({BY}, model_name, __name__) ({any_of((*RUNNING, ENGINE_UP), sel)})"


def gauge(names: tuple[str, ...], sel: str, how: str = "sum") -> str:
    return f"{how} by ({BY}) ({any_of(names, sel)})"


def per_minute(names: tuple[str, ...], sel: str) -> str:
    return f"60 * ({_sum_rate(names, sel)})"


def prefix_hit(sel: str) -> str:
    parts = []
    for hits, share in PREFIX_HIT:
        whole = " + ".join(f"sum by ({BY}) ({_rate(n.strip(), sel)})" for n in share.split("+"))
        parts.append(f"sum by ({BY}) ({_rate(hits, sel)}) / ({whole})")
    return " or ".join(parts)


def buckets(figure: str, sel: str, by: str = BY) -> str:
    """The bucket rates of ``figure`` (``ttft_s``, ``itl_s``) summed ``by (by, le)``."""
    names = tuple(f"{n}_bucket" for n in HISTOGRAMS[figure])
    return _sum_rate(names, sel, by=f"{by}, le" if by else "le")


def row_quantile(q: float, figure: str, sel: str) -> str:
    return f"histogram_quantile({q:g}, {buckets(figure, sel)})"


def fleet_quantile(q: float, figure: str, sel: str, les: list[str] | None = None) -> str:
    """The fleet's: of the bucket rates summed across every engine ``by (le)``. ``les``: only
    these bounds (the ones every engine has, when kinds bucket differently: a sum at a bound
    some engines lack is not a cumulative count)."""
    names = tuple(f"{n}_bucket" for n in HISTOGRAMS[figure])
    extra = f"le=~`{'|'.join(re.escape(le) for le in les)}`" if les else ""
    return f"histogram_quantile({q:g}, sum by (le) (rate({any_of(names, sel, extra)}[{RANGE}])))"


def kind_of(name: str) -> str:
    """The fleet kind of a metric name (``vllm:…`` → vllm; ``vconsole:…`` → vconsole)."""
    prefix = name.split(":", 1)[0]
    return "vconsole" if prefix == "vconsole" else KIND_OF_PREFIX.get(prefix, prefix)
