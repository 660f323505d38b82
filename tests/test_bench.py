import json

import pytest

from hierspec.bench.metrics import MethodRecord, QuestionRun, summarize
from hierspec.bench.questions import Question, load_questions, select_questions
from hierspec.bench.runner import BenchConfig, run_bench
from hierspec.config import ModelConfig
from hierspec.errors import InputError
from tiny import save_model_dir


@pytest.fixture
def model_dir(tmp_path):
    """A tiny Llama with its word-level tokenizer saved as a model directory."""
    return save_model_dir(tmp_path / "model", vocab_size=64, seed=8, max_positions=256)


def _q(qid, category):
    return Question(qid, category, (f"question {qid}",))


def test_summary_metrics_on_synthetic_runs():
    questions = [_q(1, "writing"), _q(2, "coding"), _q(3, "translation")]
    ar = MethodRecord("ar")
    pld = MethodRecord("pld")
    # ar: 10 tokens in 2 s, 10 tokens in 1 s, 5 tokens in 1 s -> 25 tokens / 4 s
    for q, tokens, wall in zip(questions, ([1] * 10, [2] * 10, [3] * 5), (2.0, 1.0, 1.0)):
        ar.add(q, QuestionRun(tokens, "", wall, [1] * len(tokens)))
    pld.add(questions[0], QuestionRun([1] * 10, "", 1.0, [4, 4, 2], drafted=12, accepted=7,
                                      drafted_by_source={"context": 8, "model": 4},
                                      accepted_by_source={"context": 5, "model": 2},
                                      won_by_source={"context": 2, "model": 1}))
    pld.add(questions[1], QuestionRun([2] * 9 + [7], "", 0.5, [5, 5], drafted=10, accepted=8))
    pld.add(questions[2], QuestionRun([3] * 5, "", 0.5, [1, 1, 1, 1, 1], drafted=4, accepted=0))
    summary = summarize({"ar": ar, "pld": pld}, "ar", model_name="m", max_new_tokens=10)

    assert summary["methods"]["ar"]["tokens_per_s"] == pytest.approx(25 / 4)
    assert summary["methods"]["ar"]["speedup"] == pytest.approx(1.0)
    p = summary["methods"]["pld"]
    assert p["tokens_per_s"] == pytest.approx(25 / 2)
    assert p["speedup"] == pytest.approx(2.0)
    assert p["mat"] == pytest.approx(25 / 10)
    assert p["acceptance_rate"] == pytest.approx(15 / 26)
    assert p["identical_to_ar"] == pytest.approx(2 / 3)
    mt = p["per_task"]["mt_bench"]  # writing + coding: 20 tokens in 1.5 s vs 20 tokens in 3 s
    assert mt["speedup"] == pytest.approx(2.0)
    assert mt["mat"] == pytest.approx(20 / 5)
    assert mt["identical_to_ar"] == pytest.approx(0.5)
    assert p["per_source"]["context"] == {"drafted": 8, "accepted": 5, "steps_won": 2, "acceptance_rate": 5 / 8,
                                          "won_share": 2 / 10}
    assert p["per_source"]["model"]["won_share"] == pytest.approx(1 / 10)
    tr = p["per_task"]["translation"]
    assert tr["speedup"] == pytest.approx((5 / 0.5) / 5.0)
    assert tr["mat"] == pytest.approx(1.0)
    assert p["sigma"] == pytest.approx(1 - 15 / 26)
    assert p["eta"] == pytest.approx(10 / 25)  # target forwards per output token
    assert p["nothing_accepted"] == pytest.approx(5 / 10)  # the five forwards of [1, 1, 1, 1, 1]
    assert summary["methods"]["ar"]["nothing_accepted"] == 1.0
    assert summary["methods"]["ar"]["eta"] == pytest.approx(1.0) and summary["methods"]["ar"]["sigma"] == 0.0


def test_draft_model_levels_from_drafter_reports():
    question = _q(1, "qa")
    ar, hsddw = MethodRecord("ar"), MethodRecord("hsddw")
    ar.add(question, QuestionRun([1] * 6, "", 1.0, [1] * 6))
    hsddw.add(question, QuestionRun([1] * 6, "", 1.0, [3, 3], drafted=6, accepted=4, drafter_report={
        "windows": [4, 2], "first_drafted": 10, "first_accepted": 4, "middle_tokens": 3, "deferred_steps": 5}))
    levels = summarize({"ar": ar, "hsddw": hsddw}, "ar", model_name="m", max_new_tokens=6)["methods"]["hsddw"]["levels"]
    assert levels == {"mean_window": 3.0, "steps": 2, "middle_tokens": 3, "deferred_steps": 5,
                      "first": {"drafted": 10, "accepted": 4, "sigma": pytest.approx(0.6)}}


def test_turns_add_up_their_draft_model_counts():
    from hierspec.bench.metrics import merge_turns

    turns = [QuestionRun([1] * 2, "", 0.5, [2], drafter_report={"windows": [4], "deferred_steps": 2, "tau": 1.0}),
             QuestionRun([1] * 2, "", 0.5, [2], drafter_report={"windows": [2], "deferred_steps": 3,
                                                                "middle_tokens": 1})]
    assert merge_turns(turns, [[1], [2]]).drafter_report == {"deferred_steps": 5, "middle_tokens": 1,
                                                               "windows": [4, 2]}


def test_dense_retrieval_figures_and_report(tmp_path):
    from hierspec.bench.report import write_report

    questions = [_q(1, "qa"), _q(2, "qa")]
    ar, dense = MethodRecord("ar"), MethodRecord("dense")
    for q in questions:
        ar.add(q, QuestionRun([1] * 4, "", 1.0, [1] * 4))
    dense.add(questions[0], QuestionRun([1] * 4, "", 0.5, [2, 2], drafted=4, accepted=2, drafter_report={
        "dense_queries": 2, "dense_hits": 1, "dense_search_s": 0.004}))
    dense.add(questions[1], QuestionRun([1] * 4, "", 0.8, [1, 1, 1, 1], drafter_report={
        "dense_queries": 4, "dense_hits": 0, "dense_search_s": 0.002}))
    summary = summarize({"ar": ar, "dense": dense}, "ar", model_name="m", max_new_tokens=4)
    figures = summary["methods"]["dense"]["dense"]
    assert figures == {"queries": 6, "hit_rate": pytest.approx(1 / 6), "search_ms": pytest.approx(1.0)}
    assert "levels" not in summary["methods"]["dense"] and "dense" not in summary["methods"]["ar"]
    write_report(tmp_path / "report.md", summary)
    assert "| dense | 6 | 16.7% | 1.00 |" in (tmp_path / "report.md").read_text()


def test_the_share_of_time_spent_reading_prompts_is_summed_over_turns_and_reported(tmp_path):
    """Prompt time: the prefill seconds over the wall time, turns added up; n/a for a peer that does not say."""
    from hierspec.bench.metrics import merge_turns
    from hierspec.bench.report import write_report

    question = _q(1, "qa")
    ar, hd, peer = MethodRecord("ar"), MethodRecord("hd"), MethodRecord("hf-ar")
    ar.add(question, QuestionRun([1] * 4, "", 2.0, [1] * 4, prefill_time=0.5))
    turns = [QuestionRun([1] * 2, "", 0.5, [2], prefill_time=0.25), QuestionRun([1] * 2, "", 0.5, [2],
                                                                                  prefill_time=0.05)]
    hd.add(question, merge_turns(turns, [[1], [2]]))
    peer.add(question, QuestionRun([1] * 4, "", 4.0, [1] * 4))
    summary = summarize({"ar": ar, "hd": hd, "hf-ar": peer}, "ar", model_name="m", max_new_tokens=4)
    shares = {label: m["prefill_time_share"] for label, m in summary["methods"].items()}
    assert shares == {"ar": pytest.approx(0.25), "hd": pytest.approx(0.3), "hf-ar": 0.0}
    write_report(tmp_path / "report.md", summary)
    rows = {}  # the overall table's rows (the first row of each method in the report)
    for line in (tmp_path / "report.md").read_text().splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0], line.split(" | "))
    assert rows["| hd"][-2] == "30.0%" and rows["| ar"][-2] == "25.0%" and rows["| hf-ar"][-2] == "n/a"


def test_question_loading_and_selection(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"t{i}", "second"]}
            for i, c in enumerate(["writing", "writing", "math", "qa", "qa", "qa"])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    questions = load_questions(path)
    assert [q.task for q in questions] == ["mt_bench", "mt_bench", "mt_bench", "qa", "qa", "qa"]
    assert [q.question_id for q in select_questions(questions, per_category=1)] == [0, 2, 3]
    assert [q.question_id for q in select_questions(questions, per_category=2, limit=4)] == [0, 1, 2, 3]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(InputError, match="bad.jsonl:1"):
        load_questions(bad)
    with pytest.raises(InputError, match="not found"):
        load_questions(tmp_path / "none.jsonl")


def test_bench_end_to_end_on_tiny_model(tmp_path, model_dir):
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [" ".join(f"w{(i * 7 + j) % 60 + 1}" for j in range(12))]}
            for i, cat in enumerate(["writing", "coding", "translation", "translation"])]
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    summary = run_bench(BenchConfig(questions=str(questions),
                                    # budget=off: whether a self-draft pays depends on this machine's timings
                                    methods=("hf-ar", "hf-pld", "pld", "hd:l=1", "sd:draft=self:1,budget=off"),
                                    max_new_tokens=16, out_dir=str(out)),
                        # float32: transformers' own bfloat16 numerics (the auto dtype on a native-bfloat16 CPU) are
                        # not hierspec's, so hf-pld equals ar only in float32
                        ModelConfig(spec=str(model_dir), dtype="float32"))
    assert set(summary["methods"]) == {"ar", "hf-ar", "hf-pld", "pld", "hd:l=1", "sd:draft=self:1,budget=off"}
    assert summary["methods"]["hf-pld"]["identical_to_ar"] == 1.0 and summary["methods"]["hf-pld"]["mat"] == 0.0
    for plot in ("speedup_per_task.png", "mat.png", "accept_lengths.png", "sources.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({plot})" in (out / "report.md").read_text()
    assert summary["methods"]["sd:draft=self:1,budget=off"]["identical_to_ar"] == 1.0
    assert summary["methods"]["sd:draft=self:1,budget=off"]["levels"]["mean_window"] > 0
    assert summary["drafters"]["hd:l=1"]["databases"] == ["automaton", "context", "successors"]
    assert summary["drafters"]["hd:l=1"]["config"]["l"] == 1
    calibration = summary["methods"]["hd:l=1"]["calibration"]  # scored trees: predicted against observed
    assert calibration and all(0 <= row["predicted"] <= 1 and 0 <= row["observed"] <= 1 for row in calibration)
    assert sum(row["nodes"] for row in calibration) == summary["methods"]["hd:l=1"]["drafted"]
    assert (out / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Scored trees: predicted against observed acceptance" in (out / "report.md").read_text()
    # the header says which tree attention ran (exact: every tree row bit-identical to plain decoding)
    assert f"decoder and {summary['runtime']['attention']} attention," in (out / "report.md").read_text()
    for name in ("ar", "hf-ar", "pld", "hd:l=1"):
        m = summary["methods"][name]
        assert set(m["per_task"]) == {"mt_bench", "translation"}
        assert m["identical_to_ar"] == 1.0
        lines = (out / f"answers-{name.replace(':', '_').replace('=', '-')}.jsonl").read_text().splitlines()
        assert len(lines) == 4
        choice = json.loads(lines[0])["choices"][0]
        assert {"turns", "new_tokens", "wall_time", "accept_lengths"} <= set(choice)
    assert summary["methods"]["ar"]["mat"] == 1.0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["methods"]["pld"]["speedup"] == summary["methods"]["pld"]["speedup"]
    assert {"model", "device", "dtype", "max_new_tokens", "date", "torch"} <= set(saved)
    assert "| pld |" in (out / "report.md").read_text()
    assert "## Draft-model levels" in (out / "report.md").read_text()
    assert summary["divergences"] == []
    assert "None: every method produced `ar`'s tokens on every question." in (out / "report.md").read_text()
    # transformers' prompt lookup reports no forwards and no prompt time: those figures read n/a, not 0
    hf_pld_rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| hf-pld |")]
    assert hf_pld_rows[0].count("n/a") == 7 and hf_pld_rows[0].endswith("| n/a | 1.00 |")
    pld_row = next(line for line in (out / "report.md").read_text().splitlines() if line.startswith("| pld |"))
    assert pld_row.count("n/a") == 0 and summary["methods"]["pld"]["prefill_time_share"] > 0
    assert hf_pld_rows[2] == "| hf-pld | n/a | n/a |"  # MAT per task (mt_bench, translation)
    hf_ar_row = next(line for line in (out / "report.md").read_text().splitlines() if line.startswith("| hf-ar |"))
    assert hf_ar_row.count("n/a") == 1 and hf_ar_row.endswith("| n/a | 1.00 |")  # every figure but prompt time


def test_bench_sampling_run_records_its_settings(tmp_path, model_dir):
    from hierspec.config import SamplingConfig

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["w1 w2 w3 w1 w2"]}) + "\n")
    config = BenchConfig(questions=str(questions), methods=("hf-ar", "sd:draft=self:1"), max_new_tokens=8,
                         out_dir=str(tmp_path / "out"), sampling=SamplingConfig(temperature=1.0, top_p=0.9),
                         sampling_seeds=(0, 1, 2))
    summary = run_bench(config, ModelConfig(spec=str(model_dir)))
    assert summary["sampling"]["temperature"] == 1.0 and summary["sampling"]["seeds"] == [0, 1, 2]
    spread = summary["seeds"]["sd:draft=self:1"]
    assert list(spread["speedups"]) == ["0", "1", "2"] and spread["min"] <= spread["mean"] <= spread["max"]
    assert summary["methods"]["ar"]["questions"] == 3  # one question, three seeds
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Speedup per sampling seed" in report
    assert "sampling (temperature 1.0, top-p 0.9, top-k 0, seeds 0, 1, 2)" in report
    assert summary["divergences"] == []
    # sampled outputs are not token-compared with ar, so the report must not claim they all equal it
    assert "Not checked under sampling" in report and "every method produced" not in report
    assert all(m["new_tokens"] > 0 for m in summary["methods"].values())


def test_method_lists_keep_options_together():
    from hierspec.methods import MethodSpec, split_methods

    assert split_methods("ar,pld:max_ngram=4,draft_len=8,hf-ar") == ["ar", "pld:max_ngram=4,draft_len=8", "hf-ar"]
    assert split_methods("pld:min_ngram=2, max_matches=1 ,ar") == ["pld:min_ngram=2,max_matches=1", "ar"]
    spec = MethodSpec.parse("pld:min_ngram=2,max_matches=1")
    assert spec.options == (("min_ngram", "2"), ("max_matches", "1"))
    assert spec.label == "pld:min_ngram=2,max_matches=1"


def test_workloads_prompt_files_humaneval_and_seeded_subsets(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "first"}\n{"text": "second", "category": "chat"}\n{"question": "third"}\n')
    questions = load_questions(prompts)
    assert [(q.turns, q.category) for q in questions] == [(("first",), "default"), (("second",), "chat"),
                                                          (("third",), "default")]
    (tmp_path / "empty.jsonl").write_text('{"prompt": "  "}\n')
    with pytest.raises(InputError, match="empty.jsonl:1"):
        load_questions(tmp_path / "empty.jsonl")
    humaneval = load_questions("humaneval")
    assert len(humaneval) == 164 and humaneval[0].question_id == "HumanEval/0"
    assert humaneval[0].raw and humaneval[0].task == "humaneval" and humaneval[0].turns[0].startswith("from typing")
    picked = select_questions(humaneval, limit=40, seed=3)
    assert picked == select_questions(humaneval, limit=40, seed=3)  # reproducible
    assert picked != humaneval[:40] and len(set(q.question_id for q in picked)) == 40


class _EchoRunner:
    """Records the prompts it is given and answers each with a fixed two-word text."""

    label = "echo"

    def __init__(self):
        self.prompts = []

    def run(self, prompt_ids, seed=None):
        self.prompts.append(list(prompt_ids))
        return QuestionRun([5, 6], f"w5 w6 answer{len(self.prompts)}", 0.1, [1, 1])


def test_second_turn_sees_the_first_answer():
    from hierspec.bench.runner import run_turns
    from tiny import make_target

    target = make_target("llama", vocab_size=64, seed=1)
    target.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
                                      "{% if add_generation_prompt %}assistant:{% endif %}")
    question = Question(7, "writing", ("w1 w2", "w3 w4"))
    runner = _EchoRunner()
    run = run_turns(runner, target, question)
    expected_second = target.encode_messages([{"role": "user", "content": "w1 w2"},
                                              {"role": "assistant", "content": "w5 w6 answer1"},
                                              {"role": "user", "content": "w3 w4"}])
    assert runner.prompts == [target.encode_messages([{"role": "user", "content": "w1 w2"}]), expected_second]
    assert [t["text"] for t in run.turns] == ["w5 w6 answer1", "w5 w6 answer2"]
    assert run.token_ids == [5, 6, 5, 6] and run.wall_time == pytest.approx(0.2) and run.accept_lengths == [1] * 4
    first_only = run_turns(_EchoRunner(), target, question, first_turn_only=True)
    assert len(first_only.turns) == 1


def test_compare_renders_two_summaries(tmp_path):
    from hierspec.bench.compare import compare_summaries

    def write(name, methods):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "summary.json").write_text(json.dumps({"model": "m", "methods": methods}))
        return directory

    row = {"tokens_per_s": 20.0, "speedup": 1.25, "mat": 1.5, "acceptance_rate": 0.25}
    a = write("a", {"ar": {**row, "speedup": 1.0}, "pld": row})
    b = write("b", {"ar": {**row, "speedup": 1.0}, "hd": {**row, "speedup": 1.5},
                    "hf-pld": {**row, "mat": 0.0, "acceptance_rate": 0.0, "target_forwards": 0, "new_tokens": 40}})
    table = compare_summaries(a, b / "summary.json")
    assert "| hf-pld | — | 20.00 | — | 1.250 | — | n/a | — | n/a |" in table
    assert "| pld | 20.00 | — | 1.250 | — | 1.50 | — | 25.0% | — |" in table
    assert "| hd | — | 20.00 | — | 1.500 | — | 1.50 | — | 25.0% |" in table
    with pytest.raises(InputError, match="no benchmark summary"):
        compare_summaries(a, tmp_path / "missing")


def test_hf_assisted_uses_the_draft_model_and_matches_hf_ar():
    from hierspec.bench.runner import _hf_runner
    from hierspec.config import GenerationConfig
    from hierspec.methods import DrafterContext
    from tiny import make_target

    target = make_target("llama", vocab_size=64, seed=3, layers=3)
    config = GenerationConfig(max_new_tokens=12)
    assisted = _hf_runner("hf-assisted", target, config, DrafterContext(target, draft_model="self:1"))
    plain = _hf_runner("hf-ar", target, config, DrafterContext(target))
    assert "assistant_model" in assisted.options
    assert assisted.run([5, 6, 7, 5, 6]).token_ids == plain.run([5, 6, 7, 5, 6]).token_ids
    with pytest.raises(InputError, match="--draft-model"):
        _hf_runner("hf-assisted", target, config, DrafterContext(target))
