"""Our Prometheus text parser gives what prometheus_client's gives, family for family and sample
for sample, on the text each kind of server sends; and refuses what is not Prometheus's."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.llama_cpp_stub import LlamaServerStub
from support.sglang_metrics import SglangMetrics
from support.vllm_metrics import VllmMetrics
from vconsole.console.sources.prom_text import families


def norm(fams):
    return [(f.name, f.type, [(s.name, dict(s.labels),
                               "NaN" if math.isnan(s.value) else s.value) for s in f.samples])
            for f in fams]


def texts() -> dict[str, str]:
    vm = VllmMetrics(engines=2)
    vm.step("1", running=3, waiting=1, usage=0.3, prompt=10, generation=10, finished=3, steps=3)
    legacy = VllmMetrics(engines=1, legacy=True)
    sg = SglangMetrics()
    sg.step(running=1, waiting=2, used_tokens=10, prompt=5, cached=2, finished=2, generation=5)
    ll = LlamaServerStub()
    ll.busy(0, 10, 5)
    return {"vllm": vm.text(), "vllm-legacy": legacy.text(), "sglang": sg.text(),
            "llama-cpp": ll.text()}


@pytest.mark.parametrize("kind", ["vllm", "vllm-legacy", "sglang", "llama-cpp"])
def test_each_kinds_text_parses_as_prometheus_client_parses_it(kind):
    text = texts()[kind]
    assert norm(families(text)) == norm(text_string_to_metric_families(text))


def test_escapes_timestamps_and_special_values():
    text = ('# TYPE a gauge\na{x="q\\"uo,te}",y="b\\\\n",z="l\\nm"} 1 1700000000\n'
            'b NaN\nc +Inf\nd{} -Inf\n')
    assert norm(families(text)) == norm(text_string_to_metric_families(text))
    (a, *_rest) = families(text)
    assert a.samples[0].labels == {"x": 'q"uo,te}', "y": "b\\n", "z": "l\nm"}


@pytest.mark.parametrize("text", ["this is {not prometheus\n", "<html><body>x</body></html>\n",
                                  'a{x="1"\n', "a 1 2 3\n", "a\n"])
def test_what_is_not_prometheus_is_a_value_error(text):
    with pytest.raises(ValueError):
        list(families(text))
