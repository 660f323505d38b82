"""llama.cpp as a bench peer (``llamacpp-ar``), with a stand-in for its Python binding: the tests never need it."""

import sys
import types

import pytest

from hierspec.bench.peers import LlamaCppRunner, gguf_file
from hierspec.bench.runner import make_runners
from hierspec.config import GenerationConfig, ModelConfig
from hierspec.errors import InputError, ModelLoadError
from hierspec.loading import default_model_path
from hierspec.methods import DrafterContext
from hierspec.model_names import NAMED_MODELS, models_dir
from tiny import make_target


class FakeLlama:
    """Records calls the way llama_cpp.Llama is called; generates 7, 8, 9, … then end-of-sequence (0)."""

    instances: list = []

    def __init__(self, model_path, **options):
        self.model_path, self.options, self.calls = model_path, options, []
        FakeLlama.instances.append(self)

    def reset(self):
        self.calls.append(("reset",))

    def set_seed(self, seed):
        self.calls.append(("seed", seed))

    def generate(self, tokens, **options):
        self.calls.append(("generate", list(tokens), options))
        yield from (7, 8, 9, 10, 0, 11, 12)


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    FakeLlama.instances.clear()
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative",
                        types.SimpleNamespace(LlamaPromptLookupDecoding=FakePromptLookup))
    return FakeLlama


class FakePromptLookup:
    def __init__(self, **options):
        self.options = options


def test_llamacpp_runner_feeds_the_prompt_ids_and_stops_at_eos_or_length(fake_llama_cpp, tmp_path):
    target = make_target("llama", vocab_size=64, seed=1)
    path = tmp_path / "m.gguf"
    runner = LlamaCppRunner(target, path, GenerationConfig(max_new_tokens=10), threads=2)
    assert fake_llama_cpp.instances[0].options["n_threads"] == 2
    run = runner.run([3, 4, 5])
    assert run.token_ids == [7, 8, 9, 10, 0] and run.accept_lengths == [1] * 5 and run.wall_time > 0
    calls = fake_llama_cpp.instances[0].calls
    assert calls[0] == ("reset",) and calls[1][1] == [3, 4, 5]
    assert calls[1][2]["temp"] == 0.0 and calls[1][2]["top_k"] == 1
    short = LlamaCppRunner(target, path, GenerationConfig(max_new_tokens=2), threads=1).run([3])
    assert short.token_ids == [7, 8]


def test_llamacpp_pld_drafts_with_the_bindings_prompt_lookup_and_reports_no_forwards(fake_llama_cpp, tmp_path):
    target = make_target("llama", vocab_size=64, seed=1)
    runner = LlamaCppRunner(target, tmp_path / "m.gguf", GenerationConfig(max_new_tokens=10), threads=2,
                            label="llamacpp-pld")
    draft = fake_llama_cpp.instances[0].options["draft_model"]
    assert isinstance(draft, FakePromptLookup) and draft.options == {"num_pred_tokens": 2}
    assert fake_llama_cpp.instances[0].options["logits_all"] is True
    run = runner.run([3, 4, 5])
    assert run.token_ids == [7, 8, 9, 10, 0] and run.accept_lengths == []  # MAT unknown, reported as n/a
    assert "draft_model" not in LlamaCppRunner(target, tmp_path / "m.gguf", GenerationConfig(), threads=2).llm.options
    with pytest.raises(InputError, match="unknown llama.cpp peer"):
        LlamaCppRunner(target, tmp_path / "m.gguf", GenerationConfig(), threads=2, label="llamacpp-sd")


def test_make_runners_builds_llamacpp_from_the_gguf_the_model_came_from(fake_llama_cpp, tmp_path):
    target = make_target("llama", vocab_size=64, seed=1)
    context = DrafterContext(target, model_config=ModelConfig(spec=str(tmp_path / "model.gguf")))
    runners = make_runners(target, ("llamacpp-ar", "llamacpp-pld"), GenerationConfig(max_new_tokens=4), context)
    assert [r.label for r in runners] == ["ar", "llamacpp-ar", "llamacpp-pld"]
    assert fake_llama_cpp.instances[-1].model_path == str(tmp_path / "model.gguf")
    assert gguf_file(None) == default_model_path() == gguf_file(ModelConfig())
    with pytest.raises(InputError, match="GGUF"):
        gguf_file(ModelConfig(spec="some/model-directory"))


def test_llamacpp_finds_a_short_names_file_or_says_how_to_fetch_it(tmp_path):
    config = ModelConfig(spec="qwen-coder-1.5b", cache_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="make models"):
        gguf_file(config)
    named = models_dir(tmp_path) / NAMED_MODELS["qwen-coder-1.5b"].file_name
    named.parent.mkdir(parents=True)
    named.write_bytes(b"GGUF")
    assert gguf_file(config) == named


def test_a_missing_binding_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(InputError, match=r"hierspec\[peers\]"):
        LlamaCppRunner(make_target("llama", vocab_size=64), tmp_path / "m.gguf", GenerationConfig(), threads=1)
