"""Calibration files and cost-aware drafting (trees trimmed by expected tokens per millisecond)."""

import json

import numpy as np
import pytest

from hierspec.accept import Verdict
from hierspec.calibration import CostCurve, default_curve_path, load_curve, measure_cost_curve, save_curve
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.base import Drafter
from hierspec.drafters.cost_aware import CostAwareDrafter, cut_to_depth
from hierspec.errors import InputError
from hierspec.methods import DrafterContext, make_drafter
from hierspec.tree import build_tree
from tiny import make_target

# a CPU-like curve: any draft costs 1.6 plain steps, more tokens almost nothing
CPU_LIKE = CostCurve((1, 2, 8, 64), (60.0, 96.0, 100.0, 240.0), {"model": "test"})


def test_curve_round_trip_and_errors(tmp_path):
    path = tmp_path / "curve.json"
    save_curve(CPU_LIKE, path)
    assert load_curve(path) == CPU_LIKE
    assert CPU_LIKE.cost(5) == pytest.approx(98.0) and CPU_LIKE.cost(100) == 240.0
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "magic": "other"}))
    with pytest.raises(InputError, match="not a hierspec cost curve"):
        load_curve(path)
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(InputError, match="version 99"):
        load_curve(path)
    with pytest.raises(InputError, match="hierspec calibrate"):
        load_curve(tmp_path / "missing.json")


def test_measure_cost_curve_on_a_tiny_model(tmp_path):
    target = make_target("llama", vocab_size=64, seed=0, max_positions=256)
    curve = measure_cost_curve(target, sizes=(1, 4, 2), context=16, repeats=2)
    assert curve.sizes == (1, 2, 4) and all(ms > 0 for ms in curve.ms)
    assert curve.identity["model"] == target.name
    assert default_curve_path(target, tmp_path).parent == tmp_path
    assert default_curve_path(target, tmp_path) == default_curve_path(target, tmp_path)  # stable name


def test_cut_to_depth_keeps_a_breadth_first_prefix():
    tree = build_tree(9, [[1, 2, 3], [1, 4], [5]], sources=["a", "b", "c"])
    cut = cut_to_depth(tree, 1)
    assert cut.tokens.tolist() == [9, 1, 5] and cut.sources == ("root", "a", "c")
    assert cut_to_depth(tree, 0).size == 1 and cut_to_depth(tree, 5).size == tree.size


class _Chain(Drafter):
    name = "chain"

    def propose(self, context, budget):
        return build_tree(int(context[-1]), [[1, 2, 3, 4]])


def _verdict(tree, accepted):
    return Verdict(tree, path=tuple(range(1, accepted + 1)), bonus=0, target_argmax=np.zeros(tree.size, dtype=int))


def test_depth_follows_observed_acceptance():
    drafter = CostAwareDrafter(_Chain(), CPU_LIKE, explore_every=1000)
    context = np.array([7])
    for _ in range(30):  # drafts are never accepted: drafting costs 1.6x for nothing
        tree = drafter.propose(context, 8)
        drafter.observe(_verdict(tree, 0), context)
    assert drafter.propose(context, 8).size == 1
    good = CostAwareDrafter(_Chain(), CPU_LIKE, explore_every=1000)
    for _ in range(30):  # every draft token accepted: the whole chain pays
        tree = good.propose(context, 8)
        good.observe(_verdict(tree, tree.size - 1), context)
    assert good.propose(context, 8).size == 5


def test_budget_auto_keeps_greedy_output_identical(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    path = tmp_path / "curve.json"
    save_curve(CPU_LIKE, path)
    drafter = make_drafter("pld:min_ngram=1,budget=auto", DrafterContext(target, cost_curve=str(path)))
    assert isinstance(drafter, CostAwareDrafter)
    rng = np.random.default_rng(5)
    config = GenerationConfig(max_new_tokens=40)
    for _ in range(4):
        motif = rng.integers(1, 64, size=6).tolist()
        prompt = motif * 3 + motif[:2]
        reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config)
        assert SpeculativeDecoder(target, drafter).generate(prompt, config).token_ids == reference.token_ids
    with pytest.raises(InputError, match="only value is auto"):
        make_drafter("pld:budget=7", DrafterContext(target, cost_curve=str(path)))
    with pytest.raises(InputError, match="hierspec calibrate"):
        make_drafter("pld:budget=auto", DrafterContext(target, cost_curve=str(tmp_path / "none.json")))


def test_a_missing_curve_is_measured_once_and_saved(tmp_path, monkeypatch):
    from hierspec import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no curve saved by other tests of this session
    target = make_target("llama", vocab_size=64, seed=3, max_positions=256)
    path = calibration.default_curve_path(target)
    assert not path.exists()
    cost = calibration.verification_cost(target)
    assert path.is_file()
    curve = load_curve(path)
    assert curve.sizes == calibration.AUTO_SIZES and all(ms > 0 for ms in curve.ms)
    assert curve.identity["hardware"] and curve.identity["runtime"] == target.runtime.kind
    assert cost(64) >= cost(1) > 0

    def refuse(*_args, **_kwargs):
        raise AssertionError("the saved curve should have been read")

    monkeypatch.setattr(calibration, "measure_cost_curve", refuse)
    calibration.verification_cost(target)
    assert calibration.verification_cost(make_target("llama", vocab_size=64, seed=3, max_positions=256),
                                         measure=False)(4) > 0


def test_cpu_flags_are_read_from_cpuinfo():
    from hierspec.machine import cpu_info, parse_cpuinfo

    text = "processor : 0\nmodel name : AMD EPYC 9R14\nflags : fpu sse avx2 fma avx512f avx512_bf16\n\n" \
           "processor : 1\nmodel name : other\nflags : fpu\n"
    assert parse_cpuinfo(text) == ("AMD EPYC 9R14", ("avx2", "fma", "avx512f", "avx512_bf16"))
    assert parse_cpuinfo("") == ("", ())
    info = cpu_info()
    assert info.model and info.capability and info.describe().startswith(info.model)
