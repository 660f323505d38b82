"""The device session's model parts: cut in two, joined back only when the whole matches its SHA-256."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts_for_tests import load_script


@pytest.fixture(scope="module")
def session():
    return load_script("device_session")


def test_parts_join_back_to_the_file(session, tmp_path):
    source = tmp_path / "model.gguf"
    data = bytes(range(256)) * 4099 + b"tail"
    source.write_bytes(data)
    parts = (tmp_path / "a" / "model.part", tmp_path / "b" / "model.part")
    digest = session.split_file(source, 300_001, parts)
    assert parts[0].stat().st_size == 300_001
    assert parts[1].stat().st_size == len(data) - 300_001
    joined = session.join_parts(list(parts), digest, tmp_path / "joined.gguf")
    assert joined.read_bytes() == data


def test_a_damaged_part_publishes_nothing(session, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(5000))
    parts = (tmp_path / "a" / "model.part", tmp_path / "b" / "model.part")
    digest = session.split_file(source, 1000, parts)
    out = tmp_path / "joined.gguf"
    with pytest.raises(ValueError, match="SHA-256"):  # parts in the wrong order
        session.join_parts([parts[1], parts[0]], digest, out)
    parts[1].write_bytes(parts[1].read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="SHA-256"):
        session.join_parts(list(parts), digest, out)
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
