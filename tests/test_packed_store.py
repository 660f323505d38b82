"""The int4 projections' packed stacks kept beside the weight cache (runtime/packed_store.py): a later load reads them
instead of packing, gets the very same stacks and logits, and anything that does not match this load's weights,
kernels or packing code — or a damaged, foreign or unwritable file — means packing as before."""

import errno
import logging

import pytest
import torch

from hierspec.runtime import RuntimeConfig, decoder, packed_store
from hierspec.runtime import quantized as q
from hierspec.target import TargetModel
from test_quantized import _tiny, _tiny_k_quant, _tree_logits, kernel  # noqa: F401 (kernel: a fixture)
from tiny import make_tokenizer

VOCAB = 64


def _kept_tiny(tmp_path, kernel, tiny=_tiny):
    """A tiny GGUF model and an empty directory for its caches, for a kernel whose stacks are kept."""
    if kernel in ("torch", "auto"):
        pytest.skip("PyTorch's int4 kernel packs its own way: nothing is kept")
    model, path = tiny(tmp_path)
    cache_dir = tmp_path / "converted"
    cache_dir.mkdir()
    return model, path, cache_dir


def _load(model, path, cache_dir, int4_kernel):
    return TargetModel(model, make_tokenizer(VOCAB), "tiny-int4",
                       RuntimeConfig(gguf=str(path), gguf_cache=str(cache_dir), int4_kernel=int4_kernel))


def _stacks(target):
    layers = target.runtime.decoder.layers
    projections = [target.runtime.decoder.lm_head] + [p for layer in layers
                                                      for p in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    return [stack for projection in projections for stack in projection.stacks]


def _assert_same_stacks(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y)
        for field in x.__dataclass_fields__:
            u, v = getattr(x, field), getattr(y, field)
            if isinstance(u, torch.Tensor):
                assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v), field
            else:
                assert u == v, field


def _never(*args, **kwargs):
    raise AssertionError("packed again although the packed file matches")


def _packed_files(cache_dir):
    return sorted(p.name for p in cache_dir.glob("packed-*.safetensors"))


@pytest.mark.parametrize("tiny", [_tiny, _tiny_k_quant])
def test_a_second_load_reads_the_packed_stacks_and_computes_the_same_logits(tmp_path, kernel, tiny,  # noqa: F811
                                                                            monkeypatch):
    model, path, cache_dir = _kept_tiny(tmp_path, kernel, tiny)
    first = _load(model, path, cache_dir, kernel)
    assert len(_packed_files(cache_dir)) == 1 and not list(cache_dir.glob("*.tmp"))
    with monkeypatch.context() as patched:
        patched.setattr(decoder, "pack_stacks", _never)
        patched.setattr(q.CachedWeights, "__getitem__", _never)  # not even the weight cache's codes are read
        second = _load(model, path, cache_dir, kernel)
    _assert_same_stacks(_stacks(first), _stacks(second))
    a, b = _tree_logits(first, second)
    assert torch.equal(a, b) and a.shape[-1] == VOCAB
    # a head over some tokens still reads its rows from the weight cache
    tokens = torch.tensor([3, 9, 40])
    head_a, head_b = first.runtime.head_over(tokens), second.runtime.head_over(tokens)
    rows = torch.randn(2, model.config.hidden_size)
    assert torch.equal(head_a.projection(rows)[0], head_b.projection(rows)[0])


def test_a_packed_file_of_other_code_kernels_or_weights_is_packed_again_and_replaced(tmp_path, kernel, monkeypatch,
                                                                                      caplog):  # noqa: F811
    model, path, cache_dir = _kept_tiny(tmp_path, kernel)
    reference = _stacks(_load(model, path, cache_dir, kernel))
    (name,) = _packed_files(cache_dir)
    packed = []
    real = decoder.pack_stacks
    monkeypatch.setattr(decoder, "pack_stacks", lambda *a, **k: packed.append(1) or real(*a, **k))
    monkeypatch.setattr(packed_store, "packing_code_hash", lambda: "another version of the packing code")
    with caplog.at_level(logging.INFO, logger="hierspec.runtime.packed_store"):
        again = _load(model, path, cache_dir, kernel)
    assert packed and "packed for other weights, kernels or code" in caplog.text
    _assert_same_stacks(reference, _stacks(again))
    assert _packed_files(cache_dir) == [name]  # replaced, not added beside
    packed.clear()
    _load(model, path, cache_dir, kernel)
    assert not packed  # the rewritten file matches this code


@pytest.mark.parametrize("damage", ["flip", "garbage", "foreign-entry"])
def test_a_damaged_packed_file_is_packed_again_with_the_same_result(tmp_path, kernel, damage, caplog):  # noqa: F811
    model, path, cache_dir = _kept_tiny(tmp_path, kernel)
    first = _load(model, path, cache_dir, kernel)
    (name,) = _packed_files(cache_dir)
    file = cache_dir / name
    if damage == "flip":  # bytes changed inside a tensor: the checksum finds it
        data = bytearray(file.read_bytes())
        data[-64:-48] = bytes(b ^ 0x3C for b in data[-64:-48])
        file.write_bytes(bytes(data))
    elif damage == "garbage":
        file.write_bytes(b"not a safetensors file")
    else:  # a well-formed file of this load's identity naming a stack type hierspec does not have: never built
        from safetensors import safe_open
        from safetensors.torch import save_file

        from hierspec import checksums

        with safe_open(str(file), framework="pt") as handle:
            meta = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        meta["entries"] = meta["entries"].replace('"Packed', '"os.system.Packed', 1)
        save_file(tensors, str(file), metadata=meta)
        checksums.record(cache_dir, [name])
    with caplog.at_level(logging.INFO, logger="hierspec.runtime.packed_store"):
        second = _load(model, path, cache_dir, kernel)
    assert "packing" in caplog.text
    _assert_same_stacks(_stacks(first), _stacks(second))
    a, b = _tree_logits(first, second)
    assert torch.equal(a, b)


def test_a_disk_that_refuses_the_packed_file_costs_the_packing_only(tmp_path, kernel, monkeypatch,  # noqa: F811
                                                                    caplog):
    import safetensors.torch

    model, path, cache_dir = _kept_tiny(tmp_path, kernel)

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with caplog.at_level(logging.WARNING):
        target = _load(model, path, cache_dir, kernel)
    assert "cannot be written" in caplog.text and not _packed_files(cache_dir)
    assert not list(cache_dir.glob(".packed-*"))
    assert target.runtime.kind == "int4"


def test_nothing_is_kept_without_a_cache_directory_or_for_pytorchs_kernel(tmp_path):
    model, path = _tiny(tmp_path)
    cache_dir = tmp_path / "converted"
    cache_dir.mkdir()
    if q.resolve_kernel("torch")[0] is not None:
        _load(model, path, cache_dir, "torch")
        assert not _packed_files(cache_dir)
    store = packed_store.PackedStore(None, {})
    assert store.stacks("x", lambda: ["built"]) == ["built"] and store.built == 1
    store.save()  # nowhere to write: nothing happens
