"""``hierspec datastore build`` and ``info``: turning inputs and presets into a datastore directory."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from hierspec.config import ModelConfig
from hierspec.datastore.corpus import iter_documents, preset_inputs
from hierspec.datastore.format import read_header
from hierspec.datastore.suffix import KIND as SUFFIX_KIND
from hierspec.datastore.suffix import SuffixBuildConfig, SuffixStore, build_suffix_store
from hierspec.errors import InputError
from hierspec.loading import load_tokenizer, tokenizer_fingerprint

KINDS = (SUFFIX_KIND,)


@dataclass(frozen=True)
class BuildRequest:
    """One datastore build.

    Attributes:
        kind: store kind (``suffix``).
        out_dir: the directory to create.
        inputs: ``(path, format)`` pairs; formats as in :mod:`hierspec.datastore.corpus`.
        presets: named corpora (``sharegpt``, ``python-stdlib``) added to the inputs.
        model: the model (or tokenizer) whose tokenizer the store uses.
        overwrite: replace an existing directory.
        chat_template: index each document rendered as an assistant turn of the tokenizer's chat template
            (so the store also holds the template's markup the model generates around answers).
        suffix: suffix-store builder settings.
    """

    kind: str
    out_dir: str
    inputs: tuple[tuple[str, str], ...] = ()
    presets: tuple[str, ...] = ()
    model: ModelConfig = ModelConfig()
    overwrite: bool = False
    chat_template: bool = False
    suffix: SuffixBuildConfig = SuffixBuildConfig()


def build(request: BuildRequest) -> dict:
    """Build the requested store and return its header."""
    if request.kind not in KINDS:
        raise InputError(f"unknown datastore kind {request.kind!r}; kinds: {', '.join(KINDS)}")
    inputs = [(Path(p), f) for p, f in request.inputs]
    for preset in request.presets:
        inputs += preset_inputs(preset)
    if not inputs:
        raise InputError("nothing to index: pass --input PATH or --preset NAME")
    for path, _ in inputs:
        if not path.exists():
            raise InputError(f"input not found: {path}")
    tokenizer, name = load_tokenizer(request.model)
    documents = chain.from_iterable(iter_documents(path, fmt) for path, fmt in inputs)
    if request.chat_template:
        documents = map(assistant_turn_renderer(tokenizer), documents)
    return build_suffix_store(
        documents, tokenizer, name, tokenizer_fingerprint(tokenizer), request.out_dir, request.suffix,
        sources=[f"{fmt}:{path}" for path, fmt in inputs], overwrite=request.overwrite,
    )


def assistant_turn_renderer(tokenizer):
    """A function rendering a text as one assistant turn of the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("--chat-template asked for, but this tokenizer has no chat template")

    def render(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "assistant", "content": text}], tokenize=False)

    return render


def info(directory: str) -> dict:
    """Header and sizes of a datastore."""
    header = read_header(directory)
    if header.get("kind") == SUFFIX_KIND:
        return SuffixStore.open(directory).info()
    return header
