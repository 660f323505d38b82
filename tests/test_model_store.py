"""The model-dependent store: n-gram counting, top-k, the binary table, and the resumable builder."""

import dataclasses
import json

import numpy as np
import pytest

from hierspec.config import GenerationConfig
from hierspec.datastore.draft_head import HeadBuildConfig
from hierspec.datastore.format import DatastoreError, default_store_dir
from hierspec.datastore.model_store import GENERATIONS_FILE, ModelStoreConfig, first_user_turn, select_prompts
from hierspec.datastore.ngram import NgramTable, count_ngrams, top_ngrams, write_ngram_table
from hierspec.datastore.suffix import SuffixStore
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.errors import InputError
from hierspec.methods import DrafterContext, make_drafter
from hierspec import store_builds
from hierspec.store_builds import build_model_store
from tiny import make_target

DOCS = [np.array([1, 2, 3, 1, 2, 3]), np.array([1, 2, 3, 4]), np.array([2, 3, 4])]


def test_ngrams_are_counted_once_per_document():
    grams, counts = count_ngrams(DOCS, 3)
    table = {tuple(g): int(c) for g, c in zip(grams.tolist(), counts)}
    assert table == {(1, 2, 3): 2, (2, 3, 1): 1, (3, 1, 2): 1, (2, 3, 4): 2}
    grams, counts = count_ngrams([np.array([5])], 3)
    assert grams.shape == (0, 3) and counts.shape == (0,)


def test_top_k_keeps_the_most_frequent_and_sorts_by_key_then_count():
    grams, counts = count_ngrams(DOCS, 3)
    top, top_counts = top_ngrams(grams, counts, 3, key_len=1)
    # counts: 123:2, 234:2, then 231 and 312 tie at 1 and the lexicographically first (231) wins the last place;
    # within key 2 the more frequent value comes first
    assert top.tolist() == [[1, 2, 3], [2, 3, 4], [2, 3, 1]]
    assert top_counts.tolist() == [2, 2, 1]


def _write(tmp_path, grams, counts, key_len=1, fingerprint="fp"):
    write_ngram_table(tmp_path, grams, counts, key_len, 16, "tiny", fingerprint)
    return tmp_path


def test_table_round_trip_and_lookup(tmp_path):
    grams = np.array([[1, 5, 6], [1, 7, 8], [1, 9, 9], [2, 3, 3]])
    counts = np.array([3, 5, 1, 2])
    top, top_counts = top_ngrams(grams, counts, 10, key_len=1)
    table = NgramTable.open(_write(tmp_path, top, top_counts), fingerprint="fp")
    assert len(table) == 4 and table.key_len == 1 and table.value_len == 2
    assert [v.tolist() for v in table.lookup(np.array([4, 1]), 5)] == [[7, 8], [5, 6], [9, 9]]
    assert [v.tolist() for v in table.lookup(np.array([1]), 1)] == [[7, 8]]
    assert [v.tolist() for v in table.lookup(np.array([1]), 5, min_count=2)] == [[7, 8], [5, 6]]
    assert table.lookup(np.array([3]), 5) == []
    # key 1 holds counts 5, 3, 1 (total 9): a share of 0.3 needs a count >= 2.7, 0.4 needs >= 3.6
    assert [v.tolist() for v in table.lookup(np.array([1]), 5, min_share=0.3)] == [[7, 8], [5, 6]]
    assert [v.tolist() for v in table.lookup(np.array([1]), 5, min_share=0.4)] == [[7, 8]]
    smaller = NgramTable.open(tmp_path, top_k=2)  # only the two most frequent grams: counts 5 and 3
    assert [v.tolist() for v in smaller.lookup(np.array([1]), 5)] == [[7, 8], [5, 6]]
    assert smaller.lookup(np.array([2]), 5) == []


def test_foreign_truncated_and_missing_tables_are_refused(tmp_path):
    grams, counts = top_ngrams(*count_ngrams(DOCS, 3), 10, key_len=1)
    _write(tmp_path, grams, counts)
    with pytest.raises(DatastoreError, match="built with tokenizer"):
        NgramTable.open(tmp_path, fingerprint="other")
    data = (tmp_path / "ngrams.tokens").read_bytes()
    (tmp_path / "ngrams.tokens").write_bytes(data[:-2])
    with pytest.raises(DatastoreError, match="truncated or corrupt"):
        NgramTable.open(tmp_path)
    with pytest.raises(DatastoreError, match="not found"):
        NgramTable.open(tmp_path / "nowhere")


def test_prompt_records_and_selection():
    assert first_user_turn({"turns": ["a", "b"]}) == "a"
    assert first_user_turn({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]}) == "hi"
    assert first_user_turn({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}) == "u"
    assert first_user_turn({"other": 1}) is None
    question = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting experiences."
    prompts = ["Hello there", "hello   there", question.upper(), "Écrivez un poème sur la mer, s'il vous plaît", "ok"]
    kept = list(select_prompts(prompts, exclude=[question], english_only=True))
    assert kept == ["Hello there", "ok"]


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=32, seed=2)


def _prompts():
    return [" ".join(f"w{(i * 7 + j) % 31 + 1}" for j in range(3 + i % 4)) for i in range(6)]


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_builder_writes_generations_and_table(target, tmp_path, batch_size):
    """Batched generation (continuous batching, any batch size) gives each prompt the answer of one-at-a-time
    decoding, token for token."""
    config = ModelStoreConfig(key_len=1, value_len=2, max_new_tokens=8, method="ar", batch_size=batch_size)
    header = build_model_store(target, _prompts(), tmp_path, config)
    records = [json.loads(line) for line in (tmp_path / GENERATIONS_FILE).read_text().splitlines()]
    records.sort(key=lambda r: r["index"])  # answers are written as they end
    assert [r["index"] for r in records] == list(range(6))
    plain = SpeculativeDecoder(target, NoDrafter())
    for record, prompt in zip(records, _prompts()):
        ids = target.encode_prompt(prompt)
        assert record["token_ids"] == plain.generate(ids, GenerationConfig(max_new_tokens=8)).token_ids
    docs = [np.array(r["context_tail"][-1:] + r["token_ids"]) for r in records]
    expected = top_ngrams(*count_ngrams(docs, 3), 100_000, key_len=1)
    table = NgramTable.open(tmp_path, fingerprint=target.tokenizer_fingerprint)
    assert header["num_grams"] == len(table) == expected[0].shape[0]
    assert header["num_prompts"] == 6 and header["generated_tokens"] == sum(len(r["token_ids"]) for r in records)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_interrupted_build_resumes_where_it_stopped(target, tmp_path, monkeypatch, batch_size):
    config = ModelStoreConfig(key_len=1, value_len=2, max_new_tokens=8, method="ar", batch_size=batch_size)
    reference = tmp_path / "reference"
    build_model_store(target, _prompts(), reference, config)

    original = store_builds._answers

    def failing_answers(*args):
        for n, answer in enumerate(original(*args)):
            if n == 3:
                raise KeyboardInterrupt
            yield answer

    out = tmp_path / "resumed"
    monkeypatch.setattr(store_builds, "_answers", failing_answers)
    with pytest.raises(KeyboardInterrupt):
        build_model_store(target, _prompts(), out, config)
    partial = tmp_path / ".resumed.partial"  # progress is kept beside the output, which does not exist yet
    assert len((partial / GENERATIONS_FILE).read_text().splitlines()) == 3
    assert not out.exists()
    with pytest.raises(DatastoreError, match="not found"):
        NgramTable.open(out)
    # a torn last line (killed mid-write) is dropped too
    with open(partial / GENERATIONS_FILE, "a") as handle:
        handle.write('{"index": 3, "token_')
    counted = {"n": 0}

    def counting_answers(*args):
        for answer in original(*args):
            counted["n"] += 1
            yield answer

    monkeypatch.setattr(store_builds, "_answers", counting_answers)
    build_model_store(target, _prompts(), out, config)
    assert counted["n"] == 3  # only the prompts not answered before
    assert (out / "ngrams.tokens").read_bytes() == (reference / "ngrams.tokens").read_bytes()
    assert (out / "ngrams.counts").read_bytes() == (reference / "ngrams.counts").read_bytes()
    assert not partial.exists()
    with pytest.raises(DatastoreError, match="other prompts or settings"):
        build_model_store(target, _prompts(), out, ModelStoreConfig(max_new_tokens=9, method="ar"))


def test_a_larger_limit_extends_a_finished_store_with_the_answers_it_holds(target, tmp_path, monkeypatch):
    """``make stores PROMPTS=N`` after a smaller N: the answers already generated are kept, only the new prompts are
    answered, and the table is the one a build of all of them from scratch writes; fewer, other or differently
    answered prompts are still refused without ``--overwrite``."""
    config = ModelStoreConfig(key_len=1, value_len=2, max_new_tokens=8, batch_size=2)
    reference = tmp_path / "reference"
    build_model_store(target, _prompts(), reference, config)
    out = tmp_path / "store"
    build_model_store(target, _prompts(), out, dataclasses.replace(config, limit=4))
    first = {r["index"]: r for r in map(json.loads, (out / GENERATIONS_FILE).read_text().splitlines())}
    original = store_builds._answers
    answered = []

    def counting_answers(target, encoded, config):
        answered.extend(i for i, ids in encoded.items())
        yield from original(target, encoded, config)

    monkeypatch.setattr(store_builds, "_answers", counting_answers)
    header = build_model_store(target, _prompts(), out, config)
    assert sorted(answered) == [4, 5]  # only the prompts the store did not hold
    records = {r["index"]: r for r in map(json.loads, (out / GENERATIONS_FILE).read_text().splitlines())}
    assert sorted(records) == list(range(6)) and all(records[i] == first[i] for i in range(4))
    assert header["num_prompts"] == 6
    assert (out / "ngrams.tokens").read_bytes() == (reference / "ngrams.tokens").read_bytes()
    assert (out / "ngrams.counts").read_bytes() == (reference / "ngrams.counts").read_bytes()
    assert not (tmp_path / ".store.partial").exists()
    for prompts, settings in ((_prompts()[:3], config),                                   # fewer
                              (_prompts()[1:] + ["w1 w2 w3 w4", "w5 w6"], config),        # not a continuation
                              (_prompts() + ["w1 w2"], dataclasses.replace(config, max_new_tokens=9))):
        with pytest.raises(DatastoreError, match="other prompts or settings"):
            build_model_store(target, prompts, out, settings)
    assert NgramTable.open(out).header["num_prompts"] == 6  # untouched by the refused builds


def test_the_default_stores_are_a_chat_store_a_code_store_a_head_and_a_model_store(target, tmp_path, monkeypatch,
                                                                                   capsys):
    """``--preset default`` (``make stores MODEL=...``) builds ``suffix/``, ``code/``, ``head/`` and ``model/`` where
    ``hd`` and ``rest`` find them, keeps finished ones on a second run, and ``rest:corpus=`` picks the chat or the
    code store."""
    chats = tmp_path / "sharegpt.json"
    chats.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "w1 w2 w3"}, {"from": "gpt", "value": "w4 w5 w6 w7"}]},
        {"conversations": [{"from": "human", "value": "w8 w9"}, {"from": "gpt", "value": "w10 w11"}]},
        {"conversations": [{"from": "human", "value": "w12 w13 w14"}, {"from": "gpt", "value": "w15 w16"}]},
    ]))
    sources = tmp_path / "lib"
    sources.mkdir()
    (sources / "mod.py").write_text("w20 w21 w22 w23 w24\n")
    corpora = {"sharegpt": [(chats, "sharegpt")], "python-stdlib": [(sources, "code")]}
    monkeypatch.setattr(store_builds, "preset_inputs", lambda name: corpora[name])
    monkeypatch.setattr(target.tokenizer, "chat_template",
                        "{% for m in messages %}{{ m['content'] }} {% endfor %}", raising=False)
    root = default_store_dir(target.tokenizer_fingerprint, tmp_path / "stores")
    request = store_builds.BuildRequest(kind="suffix", out_dir=None,
                                        model_store=ModelStoreConfig(max_new_tokens=3, limit=2, batch_size=2),
                                        head=HeadBuildConfig(shortlist=16, width=8, epochs=1, held_out=0.3))
    headers = store_builds.build_default_stores(target, root, request)
    out = capsys.readouterr().out
    assert "generating 2 answers: estimated" in out  # timed on the batched path
    assert "~9 minutes on a 2-core Zen 4" in out  # the head's time scales with its 300,000 positions
    assert set(headers) == {"suffix", "code", "head", "model"}
    assert headers["head"]["kind"] == "head" and headers["head"]["pairs"] > 0
    assert headers["suffix"]["kind"] == headers["code"]["kind"] == "suffix" and headers["model"]["num_prompts"] == 2
    code = SuffixStore.open(root / "code", target.tokenizer_fingerprint)
    assert code.longest_match(np.array([21, 22, 23]), 3, 2) is not None  # the source file's words are indexed
    assert SuffixStore.open(root / "suffix", target.tokenizer_fingerprint).longest_match(
        np.array([21, 22, 23]), 3, 2) is None
    capsys.readouterr()
    store_builds.build_default_stores(target, root, request)
    assert capsys.readouterr().out.count("exists; kept") == 3
    context = DrafterContext(target, store_root=str(tmp_path / "stores"))
    assert make_drafter("rest:budget=off", context).store.directory == root / "suffix"
    assert "head" in make_drafter("hd", context).sources
    assert make_drafter("rest:corpus=code,budget=off", context).store.directory == root / "code"
    with pytest.raises(InputError, match="corpus='web'"):
        make_drafter("rest:corpus=web", context)
    with pytest.raises(InputError, match="needs a 'suffix' datastore"):
        make_drafter("rest", DrafterContext(target, store_root=str(tmp_path / "none")))


def test_the_default_head_is_retrained_when_the_answers_or_its_settings_change(target, tmp_path, monkeypatch,
                                                                             capsys):
    """``make stores PROMPTS=… KEYS=…`` on a machine that has the default stores: the model store is extended and
    the head retrained on the new answers or settings; a head that already read them with these settings is kept,
    and so is one written before heads recorded their answers' count, while the model store is unchanged."""
    chats = tmp_path / "sharegpt.json"
    chats.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"w{i} w{i + 1}"},
                                                    {"from": "gpt", "value": f"w{i + 2} w{i + 3} w{i + 4}"}]}
                                 for i in range(1, 7)]))
    monkeypatch.setattr(store_builds, "preset_inputs", lambda name: [(chats, "sharegpt")] if name == "sharegpt" else [])
    monkeypatch.setattr(store_builds, "DEFAULT_SUFFIX_STORES", ())
    monkeypatch.setattr(target.tokenizer, "chat_template",
                        "{% for m in messages %}{{ m['content'] }} {% endfor %}", raising=False)
    root = tmp_path / "stores"
    head = HeadBuildConfig(shortlist=16, width=8, epochs=1, held_out=0.3)

    def build(answers: int, settings: HeadBuildConfig = head) -> str:
        request = store_builds.BuildRequest(kind="suffix", out_dir=None, head=settings,
                                            model_store=ModelStoreConfig(max_new_tokens=3, limit=answers, batch_size=2))
        capsys.readouterr()
        store_builds.build_default_stores(target, root, request)
        return capsys.readouterr().out

    assert "retrained" not in build(2)
    assert "exists; kept" in build(2)
    out = build(4)
    assert "answers to the first 2 of these prompts" in out  # the model store extended
    assert "retrained" in out
    header = json.loads((root / "head" / "header.json").read_text())
    assert header["sources"][0].endswith("(4 answers)")
    assert "exists; kept" in build(4)
    out = build(2)  # a store holding more than asked is kept, and the head that read it
    assert "holds answers to 4 prompts, these 2 first; kept" in out and "retrained" not in out
    assert json.loads((root / "model" / "header.json").read_text())["num_prompts"] == 4
    assert "exists; kept" in build(4, dataclasses.replace(head, max_keys=100))  # fewer positions asked
    assert "retrained" in build(4, dataclasses.replace(head, max_keys=10**6))
    assert "retrained" in build(4, dataclasses.replace(head, epochs=2, max_keys=10**6))
    header = json.loads((root / "head" / "header.json").read_text())
    header["sources"][0] = f"model-store:{root / 'model'}"  # as hierspec wrote it before the count
    (root / "head" / "header.json").write_text(json.dumps(header))
    assert "exists; kept" in build(4, dataclasses.replace(head, epochs=2, max_keys=10**6))
    assert "retrained" in build(5, dataclasses.replace(head, epochs=2, max_keys=10**6))


def test_the_generation_estimate_reads_every_prompt_once_and_decodes_a_batch_per_step():
    # 24 prompt tokens at 0.5 s; 4 answers x 3 tokens, 2 at a time: 6 steps at 2 s
    seconds = store_builds.batched_seconds([5, 10, 2, 7], rows=2, new_tokens=3, per_token=0.5, per_step=2.0)
    assert seconds == 24 * 0.5 + 6 * 2.0
    # 3 answers of 1 token, 2 at a time: 2 steps (the last one half full)
    assert store_builds.batched_seconds([4, 4, 4], rows=2, new_tokens=1, per_token=1.0, per_step=1.0) == 12 + 2