"""What a method's drafters learn carries from one generation to the next (``drafters/carried.py``): a new drafter
made for the same method and context starts from what the last finished generation learned, a copy of it."""

import errno
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from hierspec.calibration import CostCurve, save_curve
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.carried import CarriedState
from hierspec.methods import DrafterContext, MethodSpec, make_drafter
from tiny import make_target

CONFIG = GenerationConfig(max_new_tokens=40, stop_at_eos=False)


def _context(target, tmp_path) -> DrafterContext:
    """A context whose cost curve is in milliseconds (so that hd's source gate runs too)."""
    path = tmp_path / "curve.json"
    save_curve(CostCurve((1, 8, 64), (10.0, 12.0, 40.0), {}), path)
    return DrafterContext(target, cost_curve=str(path), find_default_stores=False)


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    prompts = []
    for _ in range(count):
        motif = rng.integers(1, 64, size=5).tolist()
        prompts.append(motif * 3 + motif[:2])
    return prompts


def test_a_carried_state_hands_out_copies_and_keeps_the_latest_left():
    slot = CarriedState()
    assert slot.latest() is None
    state = {"counts": np.zeros(3)}
    slot.leave(state)
    state["counts"][0] = 5.0  # the finished drafter goes on with its own
    taken = slot.latest()
    taken["counts"][1] = 7.0  # and so does the one that started from it
    assert slot.latest()["counts"].tolist() == [0.0, 0.0, 0.0]
    slot.leave(None)  # a drafter that learns nothing of the kind leaves the latest as it was
    assert slot.latest()["counts"].tolist() == [0.0, 0.0, 0.0]
    slot.leave({"counts": np.ones(3)})
    assert slot.latest()["counts"].tolist() == [1.0, 1.0, 1.0]


def test_a_new_hd_drafter_starts_from_what_the_last_generation_of_its_method_learned(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    first = make_drafter("hd", context)
    assert first.acceptance.trials.sum() == 0
    SpeculativeDecoder(target, first).generate(_prompts(1)[0], CONFIG)
    learned = first.acceptance.trials.copy()
    assert learned.sum() > 0
    second = make_drafter("hd", context)
    assert second.acceptance is not first.acceptance
    assert np.array_equal(second.acceptance.trials, learned)
    assert np.array_equal(second.acceptance.hits, first.acceptance.hits)
    assert second.source_gate is not first.source_gate
    assert second.source_gate.report() == first.source_gate.report()
    assert make_drafter("hd:h_gate=4", context).acceptance.trials.sum() == 0  # another method
    assert make_drafter("hd", _context(target, tmp_path)).acceptance.trials.sum() == 0  # another context


def test_hd_starts_afresh_from_what_was_learned_for_other_databases(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    drafter = make_drafter("hd", _context(target, tmp_path))
    learned = drafter.learned()
    learned["acceptance"].trials += 3.0
    other = make_drafter("hd", _context(target, tmp_path))
    other.resume({**learned, "sources": ["context"]})
    assert other.acceptance.trials.sum() == 0
    other.resume(learned)
    assert other.acceptance.trials.sum() > 0


def test_hd_keeps_learned_rates_but_its_own_prior_and_credit(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    learned = make_drafter("hd", _context(target, tmp_path)).learned()
    learned["acceptance"].trials += 3.0
    other = make_drafter("hd:prior=0.3,credit=best", _context(target, tmp_path))
    other.resume(learned)
    assert other.acceptance.trials.sum() > 0
    assert (other.acceptance.prior, other.acceptance.credit) == (0.3, "best")


def test_the_cost_aware_wrapper_carries_its_depth_counts(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    first = make_drafter("pld:min_ngram=1", context)
    SpeculativeDecoder(target, first).generate(_prompts(1)[0], CONFIG)
    assert first._reached.sum() > 0
    second = make_drafter("pld:min_ngram=1", context)
    assert second._reached is not first._reached
    assert np.array_equal(second._reached, first._reached) and np.array_equal(second._accepted, first._accepted)
    assert second._backoff.interval == first._backoff.interval


def test_drafters_that_start_from_earlier_generations_still_decode_exactly_as_plain_decoding(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    plain = SpeculativeDecoder(target, NoDrafter())
    for method in ("hd", "pld:min_ngram=1"):
        for prompt in _prompts(4):
            out = SpeculativeDecoder(target, make_drafter(method, context)).generate(prompt, CONFIG)
            assert out.token_ids == plain.generate(prompt, CONFIG).token_ids


def test_a_seeded_sampled_generation_is_the_same_whatever_an_earlier_generation_taught_the_drafter(tmp_path):
    from hierspec.config import SamplingConfig

    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    sampled = GenerationConfig(max_new_tokens=40, stop_at_eos=False,
                               sampling=SamplingConfig(temperature=0.9, seed=7))
    prompt = _prompts(1)[0]
    plain = SpeculativeDecoder(target, NoDrafter()).generate(prompt, sampled).token_ids
    first = make_drafter("hd", context)
    assert SpeculativeDecoder(target, first).generate(prompt, sampled).token_ids == plain
    later = make_drafter("hd", context)  # starts from what the first generation learned
    assert later.acceptance.trials.sum() > 0
    assert SpeculativeDecoder(target, later).generate(prompt, sampled).token_ids == plain


# --- across processes: the learned-state file ---------------------------------------------------------------------

KEY = {"method": "hd", "model": "tiny", "tokenizer": "0123456789abcdef"}


def test_a_snapshot_left_in_a_file_is_where_the_next_process_starts(tmp_path):
    from hierspec.drafters.carried import MAGIC, VERSION, learned_path

    path = learned_path(tmp_path / "learned", KEY)
    assert path.parent == tmp_path / "learned" and path.name.startswith("hd-")
    first = CarriedState(path, KEY)  # a first process: nothing there yet
    assert first.latest() is None and first.path == path
    first.leave({"counts": np.arange(3.0), "rate": 0.25})
    header = json.loads(path.read_bytes().split(b"\n")[0])
    assert header["magic"] == MAGIC and header["version"] == VERSION and header["key"] == KEY
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left beside it
    later = CarriedState(path, KEY)  # a later process
    assert later.latest()["counts"].tolist() == [0.0, 1.0, 2.0] and later.latest()["rate"] == 0.25
    assert learned_path(tmp_path, {**KEY, "method": "pld"}) != learned_path(tmp_path, KEY)


def _written(tmp_path, state=None) -> Path:
    path = tmp_path / "state.learned"
    CarriedState(path, KEY).leave(state or {"counts": np.ones(2)})
    return path


@pytest.mark.parametrize("damage", ["payload", "garbage", "version", "magic"])
def test_a_damaged_or_foreign_file_means_starting_from_the_priors_with_a_warning(tmp_path, caplog, damage):
    path = _written(tmp_path)
    data = path.read_bytes()
    line, _, payload = data.partition(b"\n")
    header = json.loads(line)
    if damage == "payload":
        data = line + b"\n" + payload[:-1] + bytes([payload[-1] ^ 1])
    elif damage == "garbage":
        data = b"\x00\x01 not a file of ours"
    else:
        header["version" if damage == "version" else "magic"] = 99 if damage == "version" else "other"
        data = json.dumps(header).encode() + b"\n" + payload
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING):
        assert CarriedState(path, KEY).latest() is None
    expected = {"payload": "checksum", "garbage": "no header", "version": "version 99", "magic": "magic"}[damage]
    assert expected in caplog.text and str(path) in caplog.text


def test_a_file_learned_for_another_model_or_method_is_not_used(tmp_path, caplog):
    path = _written(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert CarriedState(path, {**KEY, "model": "another"}).latest() is None
    assert "another model, method or setting" in caplog.text
    assert CarriedState(path, KEY).latest() is not None


def test_a_learned_state_file_never_runs_code_it_names(tmp_path, caplog):
    """A file whose header is right but whose payload names a function outside hierspec's classes, NumPy and plain
    containers is refused before anything is called."""
    import hashlib

    from hierspec.drafters.carried import VERSION

    class Runs:
        def __reduce__(self):
            return (os.remove, (str(tmp_path / "victim"),))

    (tmp_path / "victim").write_text("still here")
    payload = pickle.dumps({"x": Runs()})
    header = {"magic": "hierspec-learned", "version": VERSION, "key": KEY,
              "sha256": hashlib.sha256(payload).hexdigest()}
    path = tmp_path / "evil.learned"
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    with caplog.at_level(logging.WARNING):
        assert CarriedState(path, KEY).latest() is None
    assert (tmp_path / "victim").read_text() == "still here"
    assert "may not hold posix.remove" in caplog.text or "may not hold os.remove" in caplog.text


def test_a_disk_that_refuses_the_write_leaves_learning_in_memory_with_one_warning(tmp_path, monkeypatch, caplog):
    path = tmp_path / "state.learned"
    slot = CarriedState(path, KEY)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING):
        slot.leave({"counts": np.ones(2)})
        slot.leave({"counts": np.zeros(2)})
    assert caplog.text.count("no space left") == 1 and slot.path is None
    assert slot.latest()["counts"].tolist() == [0.0, 0.0]
    assert not path.exists() and not list(tmp_path.iterdir())  # nor a temporary file


def test_a_new_process_with_the_same_learned_dir_starts_hd_where_the_last_one_stopped(tmp_path):
    from dataclasses import replace

    target = make_target("llama", vocab_size=64, seed=3)
    context = replace(_context(target, tmp_path), learned_dir=str(tmp_path / "learned"))
    first = make_drafter("hd", context)
    SpeculativeDecoder(target, first).generate(_prompts(1)[0], CONFIG)
    learned = first.acceptance.trials.copy()
    assert learned.sum() > 0 and len(list((tmp_path / "learned").iterdir())) == 1
    # a fresh context is what a new process has: nothing in memory, the file on the disk
    again = make_drafter("hd", replace(_context(target, tmp_path), learned_dir=str(tmp_path / "learned")))
    assert np.array_equal(again.acceptance.trials, learned)
    assert make_drafter("hd", _context(target, tmp_path)).acceptance.trials.sum() == 0  # no learned_dir: afresh
    other = replace(_context(target, tmp_path), learned_dir=str(tmp_path / "learned"), datastores=("elsewhere",))
    assert other.carried_state(MethodSpec.parse("hd")).path != again.carried.path  # other stores, other file
    plain = SpeculativeDecoder(target, NoDrafter()).generate(_prompts(2)[1], CONFIG).token_ids
    assert SpeculativeDecoder(target, again).generate(_prompts(2)[1], CONFIG).token_ids == plain


def test_generate_and_serve_keep_what_drafters_learn_unless_told_not_to(tmp_path, capsys):
    from hierspec.cli import build_parser, main
    from hierspec.paths import user_cache_dir
    from tiny import save_model_dir

    model_dir = str(save_model_dir(tmp_path / "tiny", vocab_size=64, seed=5, max_positions=64))
    learned = user_cache_dir() / "learned"  # the tests' private cache (conftest)
    shutil.rmtree(learned, ignore_errors=True)
    run = ["generate", "w1 w2 w3 w1 w2 w3 w1", "--model", model_dir, "--raw", "--method", "pld:min_ngram=1",
           "--max-new-tokens", "12", "--json"]
    assert main(run + ["--no-keep-learned"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert not learned.exists()
    assert main(run) == 0 and json.loads(capsys.readouterr().out)["token_ids"] == plain
    (kept,) = learned.iterdir()
    first = CarriedState(kept, json.loads(kept.read_bytes().split(b"\n")[0])["key"]).latest()
    assert main(run) == 0 and json.loads(capsys.readouterr().out)["token_ids"] == plain
    second = CarriedState(kept, json.loads(kept.read_bytes().split(b"\n")[0])["key"]).latest()
    assert second["depths"][0].sum() > first["depths"][0].sum() > 0  # the second run went on from the first's counts
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).keep_learned is True
    assert parser.parse_args(["generate", "hi", "--no-keep-learned"]).keep_learned is False
    assert parser.parse_args(["serve", "--no-keep-learned"]).keep_learned is False


def test_the_python_api_keeps_what_it_learned_across_processes_only_when_asked():
    import hierspec
    from hierspec.errors import InputError
    from hierspec.paths import user_cache_dir

    target = make_target("llama", vocab_size=64, seed=3)
    learned = user_cache_dir() / "learned"  # the tests' private cache (conftest)
    prompt = " ".join(f"w{t}" for t in _prompts(1)[0])
    def files() -> set:
        return set(learned.iterdir()) if learned.exists() else set()

    before = files()  # other tests of this session may have left some
    plain = hierspec.generate(target, prompt, method="ar", raw=True, max_new_tokens=12).token_ids
    assert hierspec.generate(target, prompt, method="pld", raw=True, max_new_tokens=12).token_ids == plain
    assert files() == before
    kept = hierspec.generate(target, prompt, method="pld", raw=True, max_new_tokens=12, keep_learned=True)
    assert kept.token_ids == plain and len(files() - before) == 1
    with pytest.raises(InputError, match="keep_learned"):
        hierspec.generate(target, prompt, method="pld", raw=True, keep_learned="yes")
