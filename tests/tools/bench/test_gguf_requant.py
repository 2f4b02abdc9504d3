"""`gguf_requant` (issue #47): the files both engines score. A GGUF re-quantized into another type
keeps its metadata and float tensors and holds the gguf package's blocks of the dequantized
weights; the F32 file (llama.cpp's float reference) holds those dequantized weights exactly."""

from __future__ import annotations

import numpy as np

from tests.engine.worker.test_gguf_model import write_gguf
from vconsole.tools.bench import gguf_requant


def _q8(name: str, weight: np.ndarray):
    import gguf

    if name == "token_embd.weight":
        return None
    return gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0), \
        gguf.GGMLQuantizationType.Q8_0


def test_requantized_files_hold_the_dequantized_weights_in_the_new_type(tmp_path):
    import gguf

    src = write_gguf(tmp_path / "src.gguf", "llama", seed=3, encode=_q8)
    original = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    floats = gguf.GGUFReader(str(gguf_requant.requantize(src, tmp_path / "f32.gguf", "F32")))
    q4 = gguf.GGUFReader(str(gguf_requant.requantize(src, tmp_path / "q4.gguf", "Q4_1")))
    assert floats.fields["general.architecture"].contents() == "llama"
    assert q4.fields["tokenizer.ggml.tokens"].contents() == \
        gguf.GGUFReader(str(src)).fields["tokenizer.ggml.tokens"].contents()
    for f, q in zip(floats.tensors, q4.tensors, strict=True):
        was = original[f.name]
        if was.tensor_type.name == "F32":        # float tensors copied as they are
            assert f.tensor_type.name == q.tensor_type.name == "F32"
            assert np.array_equal(np.asarray(f.data), np.asarray(was.data))
            continue
        want = gguf.quants.dequantize(np.asarray(was.data), was.tensor_type)
        assert f.tensor_type.name == "F32" and np.array_equal(np.asarray(f.data), want)
        assert q.tensor_type.name == "Q4_1"
        assert np.array_equal(np.asarray(q.data), gguf.quants.quantize(
            want.astype(np.float32), gguf.GGMLQuantizationType.Q4_1))

