"""Faults of the world around hierspec, made on purpose: concurrent callers, unwritable and full disks, damaged
caches and curves. Each test checks the promised behaviour: a clear error or a degraded mode, never a wrong
answer and never an outage."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import numpy as np
import pytest
import torch

from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.errors import HierspecError
from hierspec.methods import DrafterContext, make_drafter
from tiny import make_target

PROMPTS = [[1, 5, 9, 3, 7, 2], [4, 4, 8, 1], [9, 8, 7, 6, 5, 4, 3], [2, 3]]


# ------------------------------------------------------------------------------------------- concurrent callers
def test_generations_from_several_threads_are_serialized_and_each_answer_is_its_own(monkeypatch):
    target = make_target("llama", dtype=torch.float32)
    config = GenerationConfig(max_new_tokens=12)
    decoder = SpeculativeDecoder(target, make_drafter("pld", DrafterContext(target, ())))
    alone = [decoder.generate(p, config).token_ids for p in PROMPTS]

    active, most = [0], [0]
    forward = target.forward_tree

    def slow_forward(*args, **kwargs):  # widens the window in which an unserialized generation would interleave
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.002)
        try:
            return forward(*args, **kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(target, "forward_tree", slow_forward)
    answers: dict[int, list[int]] = {}

    def work(index: int) -> None:
        answers[index] = decoder.generate(PROMPTS[index % len(PROMPTS)], config).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1
    assert all(answers[i] == alone[i % len(PROMPTS)] for i in range(8))


def test_a_second_generation_in_the_thread_holding_the_model_is_an_error_not_a_deadlock():
    target = make_target("llama", dtype=torch.float32)
    decoder = SpeculativeDecoder(target, make_drafter("ar", DrafterContext(target, ())))
    stream = iter(decoder.stream(PROMPTS[0], GenerationConfig(max_new_tokens=8)))
    next(stream)
    with pytest.raises(HierspecError, match="already generating in this thread"):
        decoder.generate(PROMPTS[1], GenerationConfig(max_new_tokens=4))
    stream.close()
    assert decoder.generate(PROMPTS[1], GenerationConfig(max_new_tokens=4)).token_ids


# ------------------------------------------------------------------------------------------- a learning store
VOCAB = 64


def _learning(directory):
    from hierspec.datastore.learning import LearningStore

    return LearningStore.open(directory, "tiny", "f" * 32, VOCAB, key_len=1, value_len=2, successor_k=3)


def _fail_after(monkeypatch, module, name: str, writes: int, code: int) -> None:
    """Make ``module.name`` raise ``OSError(code)`` from its ``writes + 1``-th call, leaving a partly written file."""
    real = getattr(module, name)
    calls = [0]

    def failing(directory, file, array):
        calls[0] += 1
        if calls[0] > writes:
            (directory / file).write_bytes(b"\0" * 7)  # what a full disk leaves: a partial file
            raise OSError(code, os.strerror(code), str(directory / file))
        return real(directory, file, array)

    monkeypatch.setattr(module, name, failing)


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES])
@pytest.mark.parametrize("writes", [0, 2])
def test_a_learning_store_that_cannot_be_written_turns_learning_off_and_leaves_nothing_behind(
        tmp_path, monkeypatch, caplog, code, writes):
    from hierspec.datastore import learning as learning_module

    store = _learning(tmp_path / "model")
    before = sorted(p.name for p in (tmp_path / "model").iterdir())
    store.add_generation(np.array([1, 2, 3, 4, 2, 3, 4]))
    _fail_after(monkeypatch, learning_module, "write_array", writes, code)
    with caplog.at_level("WARNING"):
        assert store.flush() is False
    assert store.problem is not None and str(tmp_path / "model") in store.problem
    assert caplog.text.count("learning into") == 1
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == before  # no temporaries, no half version
    assert store.pending == 0 and store.version == 1
    store.add_generation(np.array([5, 6, 7, 8]))  # nothing is held any more, nothing is retried
    assert store.pending == 0 and store.flush() is False
    monkeypatch.undo()
    assert len(_learning(tmp_path / "model").table) == 0  # the version before is intact


def test_a_learning_store_on_a_read_only_disk_opens_with_learning_off(tmp_path, monkeypatch, caplog):
    import hierspec.storage as storage

    _learning(tmp_path / "model")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", kwargs.get("dir"))

    monkeypatch.setattr(storage.tempfile, "mkstemp", read_only)
    with caplog.at_level("WARNING"):
        store = _learning(tmp_path / "model")
    assert "read-only" in store.problem and "read-only" in caplog.text
    store.add_generation(np.array([1, 2, 3, 4]))
    assert store.pending == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="permissions do not bind root")
def test_a_learning_store_in_a_directory_without_write_permission_opens_with_learning_off(tmp_path):
    _learning(tmp_path / "model")
    (tmp_path / "model").chmod(0o500)
    try:
        store = _learning(tmp_path / "model")
        assert "permission denied" in store.problem
        assert store.flush() is False
    finally:
        (tmp_path / "model").chmod(0o700)


def test_a_learning_store_that_cannot_be_created_is_a_clear_error(tmp_path):
    from hierspec.datastore.format import DatastoreError

    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DatastoreError, match="cannot create the learning store .*file/model"):
        _learning(tmp_path / "file" / "model")


def test_two_writers_of_one_learning_store_keep_each_others_successors(tmp_path):
    first, second = _learning(tmp_path / "model"), _learning(tmp_path / "model")
    first.successors.update(np.array([2]), np.array([[3, 5, 7]]))
    first.add_generation(np.array([1, 2, 3, 4]))
    assert first.flush()
    second.successors.update(np.array([9]), np.array([[1, 1, 2]]))
    second.add_generation(np.array([1, 2, 3, 4]))
    assert second.flush()
    merged = _learning(tmp_path / "model")
    assert merged.successors.table[2].tolist() == [3, 5, 7] and merged.successors.table[9].tolist() == [1, 1, 2]
    grams, counts = merged.table.grams_and_counts()
    assert dict(zip(map(tuple, grams.tolist()), counts.tolist())) == {(1, 2, 3): 2, (2, 3, 4): 2}


def test_verify_finds_a_truncated_successor_table(tmp_path):
    from hierspec.datastore.format import DatastoreError
    from hierspec.store_builds import info

    store = _learning(tmp_path / "model")
    store.add_generation(np.array([1, 2, 3, 4]))
    store.flush()
    assert info(str(tmp_path / "model"), verify=True)["verified"]["ok"]
    successors = max((tmp_path / "model").glob("successors-*.i32"))  # the current version's
    successors.write_bytes(successors.read_bytes()[:-40])
    with pytest.raises(DatastoreError, match="size|bytes"):
        info(str(tmp_path / "model"), verify=True)


def test_the_server_keeps_answering_and_reports_degraded_when_learning_cannot_be_written(tmp_path, monkeypatch):
    import httpx

    from hierspec.datastore import learning as learning_module
    from live_server import LiveServer

    target = make_target("llama", vocab_size=VOCAB, seed=5, max_positions=128)
    context = DrafterContext(target, store_root=str(tmp_path))
    drafter = make_drafter("hd:learn=true,flush_every=1", context)
    _fail_after(monkeypatch, learning_module, "write_array", 0, errno.ENOSPC)
    reference = SpeculativeDecoder(target, make_drafter("ar", context))
    with LiveServer(target, drafter) as server:
        for i in range(10):
            response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                                  json={"model": "tiny", "prompt": f"w{i + 1} w{i + 2} w3", "max_tokens": 8,
                                        "temperature": 0})
            assert response.status_code == 200, response.text
            ids = target.encode_prompt(f"w{i + 1} w{i + 2} w3", raw=True)
            assert response.json()["choices"][0]["text"] == reference.generate(
                ids, GenerationConfig(max_new_tokens=8)).text
        health = httpx.get(f"{server.url}/health").json()
        metrics = httpx.get(f"{server.url}/metrics").text
    assert health["status"] == "degraded" and "no space left" in health["problems"][0]
    assert "hierspec_degraded_conditions 1.0" in metrics
    assert not list(tmp_path.rglob("*.tmp"))


# ------------------------------------------------------------------------------------------- storage errors at the CLI
def test_a_full_disk_while_calibrating_is_one_error_line_and_leaves_no_temporary(tmp_path, monkeypatch, capsys):
    from hierspec import storage
    from hierspec.cli import main
    from tiny import save_model_dir

    model = save_model_dir(tmp_path / "tiny", vocab_size=64, seed=5, max_positions=64)

    def full_disk(fd):  # the disk reports it full when the written bytes are forced out
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.os, "fsync", full_disk)
    out = tmp_path / "curves" / "curve.json"
    code = main(["calibrate", "--model", str(model), "--max-tokens", "2", "--context", "8", "--repeats", "1",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("hierspec: error: no space left on the device")
    assert sum(line.startswith("hierspec: error") for line in err) == 1 and "Traceback" not in "\n".join(err)
    assert list((tmp_path / "curves").iterdir()) == []


def test_other_os_errors_are_not_dressed_as_storage_errors():
    from hierspec.storage import is_storage_error, storage_problem

    assert not is_storage_error(OSError(errno.ECONNRESET, "reset")) and not is_storage_error(ValueError())
    assert storage_problem(OSError(errno.EROFS, "x", "/mnt/store")) == (
        "the file system is read-only; choose a writable directory (/mnt/store)")


# ------------------------------------------------------------------------------------------- damaged caches and curves
def test_checksums_find_any_write_to_a_cached_file_and_cost_only_a_stat_otherwise(tmp_path, monkeypatch):
    from hierspec import checksums

    (tmp_path / "weights.bin").write_bytes(os.urandom(1 << 16))
    (tmp_path / "config.json").write_text("{}")
    checksums.record(tmp_path, ["weights.bin", "config.json"])
    assert checksums.damage(tmp_path) is None

    def no_hashing(path):
        raise AssertionError("an untouched file is not hashed again")

    monkeypatch.setattr(checksums, "file_sha256", no_hashing)
    assert checksums.damage(tmp_path) is None
    monkeypatch.undo()
    data = bytearray((tmp_path / "weights.bin").read_bytes())
    data[1000:1004] = bytes(b ^ 0xFF for b in data[1000:1004])  # same size, new bytes
    (tmp_path / "weights.bin").write_bytes(bytes(data))
    assert "does not match its SHA-256" in checksums.damage(tmp_path)
    (tmp_path / "weights.bin").write_bytes(bytes(data[:-10]))
    assert "bytes" in checksums.damage(tmp_path)
    (tmp_path / "weights.bin").unlink()
    assert "missing" in checksums.damage(tmp_path)
    (tmp_path / checksums.MANIFEST).write_text("garbage")
    assert "no readable" in checksums.damage(tmp_path)


def test_a_touched_but_intact_file_is_hashed_once_then_trusted_again(tmp_path, monkeypatch):
    from hierspec import checksums

    (tmp_path / "weights.bin").write_bytes(b"abc" * 1000)
    checksums.record(tmp_path, ["weights.bin"])
    os.utime(tmp_path / "weights.bin", ns=(1, 1))  # copied without its times, say
    assert checksums.damage(tmp_path) is None
    monkeypatch.setattr(checksums, "file_sha256", lambda path: pytest.fail("hashed twice"))
    assert checksums.damage(tmp_path) is None


def test_a_gguf_files_hash_is_remembered_by_its_path_size_and_time_and_taken_again_when_they_change(
        tmp_path, monkeypatch):
    from hierspec import checksums

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + os.urandom(4096))
    memo = tmp_path / "cache" / "gguf"
    first = checksums.remembered_sha256(model, memo)
    assert first == checksums.file_sha256(model) and (memo / checksums.SOURCES).is_file()
    with monkeypatch.context() as patched:
        patched.setattr(checksums, "file_sha256", lambda path: pytest.fail("an untouched file is not hashed again"))
        assert checksums.remembered_sha256(model, memo) == first
    model.write_bytes(b"GGUF" + os.urandom(4096))  # new contents, same size
    os.utime(model, ns=(5, 5))
    assert checksums.remembered_sha256(model, memo) == checksums.file_sha256(model) != first
    (memo / checksums.SOURCES).write_text("garbage")  # a damaged memo: hashed, and the memo written anew
    assert checksums.remembered_sha256(model, memo) == checksums.file_sha256(model)
    assert json.loads((memo / checksums.SOURCES).read_text())["magic"] == checksums.MAGIC
    (memo / checksums.SOURCES).unlink()
    memo.chmod(0o500)  # a memo that cannot be written costs the hash only
    try:
        if os.access(memo, os.W_OK):  # root writes anyway: then make the write itself fail
            monkeypatch.setattr(checksums, "write_json_atomic", lambda *a, **k: (_ for _ in ()).throw(
                OSError(errno.EROFS, "Read-only file system")))
        assert checksums.remembered_sha256(model, memo) == checksums.file_sha256(model)
        assert not (memo / checksums.SOURCES).exists()
    finally:
        memo.chmod(0o700)


def _fake_conversion(tmp_path, monkeypatch):
    """A GGUF file whose conversion (counted in the returned list) leaves what convert_gguf leaves: the files and
    their checksums; the model configuration that loads it."""
    from hierspec import checksums, loading
    from hierspec.config import ModelConfig

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(256))
    converted = []

    def convert(source, out_dir):
        converted.append(source)
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"weights" * 1000)
        checksums.record(out_dir, ["model.safetensors"])

    monkeypatch.setattr(loading, "convert_gguf", convert)
    return ModelConfig(spec=str(gguf), cache_dir=str(tmp_path / "cache")), converted


def test_a_deleted_or_damaged_int4_cache_beside_the_converted_weights_does_not_convert_the_file_again(
        tmp_path, monkeypatch):
    """The int4 blocks and their packed stacks have their own checks and rebuild themselves: deleting them (to free
    disk) or damaging them leaves the converted weights in use, and their names are the ones the loading skips."""
    from hierspec import checksums, loading
    from hierspec.runtime import packed_store
    from hierspec.runtime import quantized as q

    for name in (q.CACHE_FILE, q.REQUANTIZED_CACHE_FILE, packed_store.store_name(q.CACHE_FILE, "vnni8", "vnni8")):
        assert name.startswith(loading.DERIVED_CACHES), name
    config, converted = _fake_conversion(tmp_path, monkeypatch)
    path, _ = loading.materialize(config)
    directory = tmp_path / "cache" / path.split("/cache/")[1]
    for name in (q.CACHE_FILE, "packed-int4-weights-vnni8-vnni8.safetensors"):
        (directory / name).write_bytes(b"derived" * 10)
    checksums.record(directory, [q.CACHE_FILE, "packed-int4-weights-vnni8-vnni8.safetensors"])
    (directory / "packed-int4-weights-vnni8-vnni8.safetensors").unlink()
    (directory / q.CACHE_FILE).write_bytes(b"changed")
    assert loading.materialize(config)[0] == path and len(converted) == 1
    (directory / "model.safetensors").write_bytes(b"w")  # the converted weights themselves are still checked
    loading.materialize(config)
    assert len(converted) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-checksums"])
def test_damaged_converted_weights_are_converted_again_with_a_warning(tmp_path, monkeypatch, caplog, damage):
    from hierspec import checksums, loading

    config, converted = _fake_conversion(tmp_path, monkeypatch)
    path, _ = loading.materialize(config)
    assert loading.materialize(config)[0] == path and len(converted) == 1  # an intact cache is used as it is
    weights = tmp_path / "cache" / path.split("/cache/")[1] / "model.safetensors"
    if damage == "flip":
        weights.write_bytes(b"weightz" + weights.read_bytes()[7:])
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        (weights.parent / checksums.MANIFEST).unlink()
    with caplog.at_level("WARNING"):
        assert loading.materialize(config)[0] == path
    assert len(converted) == 2 and "are damaged" in caplog.text and "converting" in caplog.text
    assert weights.read_bytes() == b"weights" * 1000
    left = [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.name != checksums.SOURCES]
    assert left == [weights.parent.name]  # nothing left aside


@pytest.mark.parametrize("text", [b"\xff\xfe\x00garbage", b'{"magic": "hierspec-cost-curve", "version": 1}',
                                  b'{"magic": "hierspec-cost-curve", "version": 1, "sizes": [1, 2], "ms": [NaN, 3]}',
                                  b'{"magic": "hierspec-cost-curve", "version": 1, "sizes": [1, 2], "ms": [5, -3]}',
                                  b'{"magic": "hierspec-cost-curve", "version": 1, "sizes": [2, 1], "ms": [5, 6]}',
                                  b'{"magic": "hierspec-cost-curve", "version": 1, "sizes": "12", "ms": [5, 6]}',
                                  b'[1, 2]'])
def test_a_damaged_cost_curve_is_a_clear_error_when_named_and_ignored_with_a_warning_when_found(
        tmp_path, monkeypatch, caplog, text):
    from hierspec import calibration
    from hierspec.errors import InputError

    path = tmp_path / "curve.json"
    path.write_bytes(text)
    with pytest.raises(InputError, match="curve"):
        calibration.load_curve(path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target = make_target("llama", vocab_size=64, seed=3, max_positions=256)
    saved = calibration.default_curve_path(target)
    saved.parent.mkdir(parents=True)
    saved.write_bytes(text)
    with caplog.at_level("WARNING"):
        cost = calibration.verification_cost(target, measure=False)
    assert "ignoring a damaged cost curve" in caplog.text
    assert 0 < cost(1) <= cost(8) < float("inf")
    calibration.verification_cost(target)  # measured again and saved in its place
    assert calibration.load_curve(saved).sizes == calibration.AUTO_SIZES


def test_a_suffix_store_with_out_of_range_entries_is_refused_at_open(tmp_path):
    from hierspec.datastore.format import DatastoreError
    from hierspec.datastore.suffix import SuffixStore, build_suffix_store
    from hierspec.loading import tokenizer_fingerprint
    from tiny import make_tokenizer

    tokenizer = make_tokenizer(VOCAB)
    out = tmp_path / "suffix"
    build_suffix_store(["w1 w2 w3 w4 w5", "w5 w6 w7 w1 w2"], tokenizer, "tiny", tokenizer_fingerprint(tokenizer), out)
    SuffixStore.open(out)
    (sa_file,) = out.glob("*.sa")
    sa = np.fromfile(sa_file, dtype=SuffixStore.open(out).shards[0][1].dtype)
    good = sa.copy()
    sa[3] = sa.shape[0] + 5
    sa.tofile(sa_file)
    with pytest.raises(DatastoreError, match="points outside its tokens.*datastore info --verify"):
        SuffixStore.open(out)
    good.tofile(sa_file)
    (tokens_file,) = out.glob("*.tokens")
    tokens = np.fromfile(tokens_file, dtype=SuffixStore.open(out).shards[0][0].dtype)
    tokens[1] = VOCAB + 1  # neither a token nor the separator
    tokens.tofile(tokens_file)
    with pytest.raises(DatastoreError, match="outside the vocabulary"):
        SuffixStore.open(out)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_error_during_a_datastore_build_is_one_error_line_and_leaves_no_temporaries(
        tmp_path, monkeypatch, capsys, code):
    from hierspec.cli import main
    from hierspec.datastore import suffix
    from tiny import save_model_dir

    model = save_model_dir(tmp_path / "tiny", vocab_size=64, seed=5, max_positions=64)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w5 w6 w7 w8 w9 w10 w11 w12\nw1 w2 w3\n")
    out_root = tmp_path / "stores"
    out_root.mkdir()
    _fail_after(monkeypatch, suffix, "write_array", 1, code)
    status = main(["datastore", "build", "--kind", "suffix", "--tokenizer", str(model), "--input", str(corpus),
                   "--out", str(out_root / "suffix")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # progress bars aside
    assert status == 2 and len(errors) == 1 and errors[0].startswith("hierspec: error: ") and "Traceback" not in err
    assert ("no space left" if code == errno.ENOSPC else "read-only") in errors[0] and str(out_root) in errors[0]
    assert list(out_root.iterdir()) == []  # no store, no temporaries, no lock


def test_a_real_size_limit_during_a_datastore_build_is_one_error_line_and_leaves_no_temporaries(tmp_path):
    """No injection: the build runs in a process whose file-size limit (``ulimit -f``) is exceeded by its arrays,
    so every write is the real one (``ndarray.tofile`` reported such a failure without an errno)."""
    import subprocess
    import sys

    from tiny import save_model_dir

    model = save_model_dir(tmp_path / "tiny", vocab_size=64, seed=5, max_positions=64)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i % 60 + 1}" for i in range(20000)) + "\n")
    out_root = tmp_path / "stores"
    out_root.mkdir()
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (30000, 30000)); from hierspec.cli import main; "
              "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", script, "datastore", "build", "--kind", "suffix", "--tokenizer",
                           str(model), "--input", str(corpus), "--out", str(out_root / "suffix")],
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and errors[0].startswith("hierspec: error: the file grew past the size")
    assert str(out_root) in errors[0] and list(out_root.iterdir()) == []


def test_a_full_disk_while_converting_a_gguf_file_is_an_os_error_and_leaves_no_temporaries(tmp_path, monkeypatch):
    """safetensors reports a failed write as its own error type; the conversion turns it into the OSError the
    command line prints as one line, and removes its temporary directory."""
    import safetensors.torch
    from safetensors import SafetensorError

    from hierspec import loading
    from hierspec.storage import is_storage_error

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    import transformers

    from tiny import make_model, make_tokenizer

    # the GGUF reading itself is transformers' (seconds); a tiny model stands for what it returns
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: make_model("llama", vocab_size=64, dtype=torch.float32))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: make_tokenizer(64))
    monkeypatch.setattr(safetensors.torch, "save_model", full_disk)
    out = tmp_path / "cache" / "gguf" / "converted"
    with pytest.raises(OSError) as caught:
        loading.convert_gguf(tmp_path / "model.gguf", out)
    assert is_storage_error(caught.value) and caught.value.errno == errno.ENOSPC
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_a_first_writer_file_appears_whole_once_and_a_later_writer_leaves_it_as_it_is(tmp_path, monkeypatch):
    from hierspec.storage import write_json_first

    path = tmp_path / "choice.json"
    assert write_json_first(path, {"kernel": "first"}) is True
    assert write_json_first(path, {"kernel": "second"}) is False
    assert json.loads(path.read_text()) == {"kernel": "first"}
    assert [p.name for p in tmp_path.iterdir()] == ["choice.json"]  # no temporary left by either call
    # a file system without hard links: a file found there is still kept, a missing one still written
    monkeypatch.setattr(os, "link", lambda src, dst: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    assert write_json_first(path, {"kernel": "third"}) is False
    assert write_json_first(tmp_path / "other.json", {"kernel": "fourth"}) is True
    assert json.loads((tmp_path / "other.json").read_text()) == {"kernel": "fourth"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["choice.json", "other.json"]


def _curve_writer(path):
    from hierspec.calibration import CostCurve, save_curve

    return lambda n: save_curve(CostCurve((1, 8), (10.0, 12.0 + n), {}), path / "curve.json")


def _manifest_writer(path):
    from hierspec import checksums

    (path / "weights.bin").write_bytes(b"weights")
    return lambda n: checksums.record(path, ["weights.bin"]) if n == 0 else checksums._write_manifest(path, {})


def _header_writer(path):
    from hierspec.datastore.format import write_header

    return lambda n: write_header(path, {"kind": "suffix", "n": n})


def _learned_writer(path):
    from hierspec.storage import write_bytes_atomic

    return lambda n: write_bytes_atomic(path / "hd.learned", b"state %d" % n)


@pytest.mark.parametrize("writer", [_curve_writer, _manifest_writer, _header_writer, _learned_writer])
def test_every_atomic_writer_keeps_the_old_file_on_a_full_disk_and_writes_readable_files(tmp_path, monkeypatch, writer):
    """Cost curves, checksum manifests, store headers and learned-state files go through one temporary-file writer:
    a write the disk refuses leaves the file before it whole and no temporary beside it, and what is written is
    readable by the other users of a shared cache (0644, not mkstemp's 0600)."""
    from hierspec import storage

    write = writer(tmp_path)
    write(0)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    written = [p for p in tmp_path.iterdir() if p.name != "weights.bin"]
    assert len(written) == 1 and written[0].stat().st_mode & 0o777 == storage.FILE_MODE

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.os, "fsync", full_disk)
    with pytest.raises(OSError) as caught:
        write(1)
    assert storage.is_storage_error(caught.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the old file, nothing beside it


def test_a_file_written_by_name_appears_whole_with_the_shared_mode_or_not_at_all(tmp_path):
    """write_file_atomic (the int4 weight cache, the packed stacks: writers that take a file name) leaves the old
    file and no temporary when the writer fails, and a readable file when it succeeds."""
    from hierspec import storage

    path = tmp_path / "weights.safetensors"
    storage.write_file_atomic(path, lambda name: open(name, "wb").write(b"first"))
    assert path.read_bytes() == b"first" and path.stat().st_mode & 0o777 == storage.FILE_MODE

    def full_disk(name):
        with open(name, "wb") as handle:
            handle.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", name)

    with pytest.raises(OSError):
        storage.write_file_atomic(path, full_disk)
    assert [p.name for p in tmp_path.iterdir()] == ["weights.safetensors"] and path.read_bytes() == b"first"
