"""The weight-floor script counts the bytes a decoding step streams: the token table only when it is the head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from scripts_for_tests import load_script


@pytest.fixture(scope="module")
def floor():
    return load_script("weight_floor")


def write_gguf(path: Path, shapes: dict[str, tuple[int, int]]) -> Path:
    writer = GGUFWriter(str(path), "llama")
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tied_embeddings_count_whole_and_an_own_head_replaces_them(floor, tmp_path):
    layer = {"blk.0.attn_q.weight": (8, 8), "blk.0.ffn_down.weight": (8, 16)}  # 64 + 128 floats
    tied = write_gguf(tmp_path / "tied.gguf", {"token_embd.weight": (32, 8), **layer})
    assert floor.weight_bytes(tied) == 4 * (256 + 64 + 128)
    untied = write_gguf(tmp_path / "untied.gguf", {"token_embd.weight": (32, 8), "output.weight": (16, 8), **layer})
    assert floor.weight_bytes(untied) == 4 * (128 + 64 + 128)  # the output head, not the table a step reads a row of
