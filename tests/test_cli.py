"""The command line on a tiny local model: normal runs and clear errors for bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from hierspec.cli import main
from tiny import make_model, make_tokenizer, save_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_model_dir(tmp_path_factory.mktemp("tiny-llama"), vocab_size=64, seed=5, max_positions=64))


def _model_with_another_tokenizer(tmp_path):
    return save_model_dir(tmp_path / "other-model", vocab_size=80, seed=5, max_positions=64)


def _run(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_with_stats(capsys, model_dir):
    code, out, _ = _run(capsys, "generate", "w1 w2 w3 w1 w2", "--model", model_dir, "--raw", "--method", "pld",
                        "--max-new-tokens", "6", "--json")
    assert code == 0
    result = json.loads(out)
    assert 1 <= len(result["token_ids"]) <= 6
    assert result["stats"]["new_tokens"] == len(result["token_ids"])
    assert result["finish_reason"] in {"eos", "length"}


def test_generate_ar_and_pld_agree(capsys, model_dir):
    outputs = []
    for method in ("ar", "pld"):
        code, out, _ = _run(capsys, "generate", "w5 w6 w7 w5 w6", "--model", model_dir, "--raw", "--method", method,
                            "--max-new-tokens", "12", "--json")
        assert code == 0
        outputs.append(json.loads(out)["token_ids"])
    assert outputs[0] == outputs[1]


def test_stream_and_stats_output(capsys, model_dir):
    code, out, err = _run(capsys, "generate", "w1 w2", "--model", model_dir, "--raw", "--stream", "--stats",
                          "--max-new-tokens", "4", "--temperature", "0.8", "--seed", "3")
    assert code == 0
    assert "tokens/s" in err and "MAT" in err


@pytest.mark.parametrize("args, message", [
    (["generate", "   "], "prompt is empty"),
    (["generate", "w1 " * 80], "context holds 64"),
    (["generate", "w1", "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
    (["generate", "w1", "--max-new-tokens", "-3"], "max_new_tokens must be a positive integer"),
    (["generate", "w1", "--temperature", "-0.5"], "temperature must be a number >= 0"),
    (["generate", "w1", "--temperature", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "w1", "--temperature", "1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "w1", "--top-k", "-1"], "top_k must be an integer >= 0"),
    (["generate", "w1", "--method", "nope"], "unknown method 'nope'"),
    (["generate", "w1", "--method", "pld:bogus=1"], "has no option 'bogus'"),
    (["generate", "w1", "--draft-vocab", "-1"], "--draft-vocab must be 0"),
])
def test_bad_input_gives_one_clear_line(capsys, model_dir, args, message):
    code, out, err = _run(capsys, *args, "--model", model_dir, "--raw")
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("hierspec: error:")


def test_an_unknown_draft_requantization_is_refused_by_the_parser(capsys, model_dir):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "w1", "--model", model_dir, "--draft-requantize", "2bit"])
    assert exit_info.value.code == 2 and "invalid choice: '2bit'" in capsys.readouterr().err


def test_an_unknown_prompt_kernel_is_refused_by_the_parser_and_a_known_one_reaches_the_model_config(capsys):
    from hierspec.cli import _model_config, build_parser

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "w1", "--prompt-kernel", "fast"])
    assert exit_info.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err
    args = build_parser().parse_args(["generate", "w1", "--prompt-kernel", "vnni"])
    assert _model_config(args).prompt_kernel == "vnni"
    assert _model_config(build_parser().parse_args(["generate", "w1"])).prompt_kernel == "auto"


def test_the_decoder_choice_reaches_the_runtime_and_an_unknown_one_is_refused(capsys):
    from hierspec.cli import _model_config, build_parser
    from hierspec.config import ModelConfig
    from hierspec.errors import InputError
    from hierspec.target import runtime_config

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "w1", "--decoder", "fast"])
    assert exit_info.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err
    config = _model_config(build_parser().parse_args(["generate", "w1", "--decoder", "transformers"]))
    assert config.decoder == "transformers"
    assert runtime_config(config, make_model("llama", vocab_size=64)).decoder == "transformers"
    assert _model_config(build_parser().parse_args(["generate", "w1"])).decoder == "auto"
    with pytest.raises(InputError, match="unknown decoder"):
        ModelConfig(decoder="owned")


def test_missing_model_is_a_clear_error(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert code == 2 and "GGUF file not found" in err


def test_console_script_prints_no_traceback(model_dir):
    proc = subprocess.run([sys.executable, "-m", "hierspec.cli", "generate", "", "--model", model_dir],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "hierspec: error: the prompt is empty"


@pytest.fixture(scope="module")
def store_dir(model_dir, tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "a.txt").write_text("w5 w6 w7 w8 w9 w10 w11 w12\n")
    (corpus / "b.jsonl").write_text(json.dumps({"text": "w5 w6 w7 w1 w2 w3"}) + "\n")
    out = corpus.parent / (corpus.name + "-store")
    assert main(["datastore", "build", "--kind", "suffix", "--tokenizer", model_dir, "--input",
                 str(corpus / "a.txt"), "--input", str(corpus / "b.jsonl"), "--out", str(out)]) == 0
    return str(out)


def test_datastore_info(capsys, store_dir):
    code, out, _ = _run(capsys, "datastore", "info", store_dir)
    info = json.loads(out)
    assert code == 0 and info["kind"] == "suffix" and info["num_documents"] == 2 and info["bytes_per_token"] > 0


def test_generate_rest_matches_ar(capsys, model_dir, store_dir):
    outputs = []
    for method in ("ar", "rest"):
        code, out, _ = _run(capsys, "generate", "w4 w5 w6", "--model", model_dir, "--raw", "--method", method,
                            "--datastore", store_dir, "--max-new-tokens", "12", "--json")
        assert code == 0
        outputs.append(json.loads(out)["token_ids"])
    assert outputs[0] == outputs[1]


def test_rest_without_store_and_with_foreign_store(capsys, model_dir, store_dir, tmp_path):
    code, _, err = _run(capsys, "generate", "w1", "--model", model_dir, "--raw", "--method", "rest")
    assert code == 2 and "needs a 'suffix' datastore" in err
    other = _model_with_another_tokenizer(tmp_path)
    code, _, err = _run(capsys, "generate", "w1", "--model", str(other), "--raw", "--method", "rest",
                        "--datastore", store_dir)
    assert code == 2 and "was built with tokenizer" in err and "rebuild" in err


def test_datastore_build_errors(capsys, model_dir, store_dir, tmp_path):
    code, _, err = _run(capsys, "datastore", "build", "--tokenizer", model_dir, "--out", str(tmp_path / "x"))
    assert code == 2 and "nothing to index" in err
    code, _, err = _run(capsys, "datastore", "build", "--tokenizer", model_dir, "--input", str(tmp_path / "none"),
                        "--out", str(tmp_path / "x"))
    assert code == 2 and "input not found" in err
    code, _, err = _run(capsys, "datastore", "build", "--tokenizer", model_dir, "--input", model_dir,
                        "--out", store_dir)
    assert code == 2 and "already exists" in err
    code, _, err = _run(capsys, "datastore", "info", str(tmp_path))
    assert code == 2 and "not a hierspec datastore" in err


def test_datastore_build_with_chat_template(capsys, model_dir, tmp_path):
    model = tmp_path / "chat-model"
    make_model("llama", vocab_size=64, seed=5, max_positions=64).save_pretrained(model)
    tokenizer = make_tokenizer(64)
    tokenizer.chat_template = "{% for m in messages %}w60 {{ m['content'] }} w61 {% endfor %}"
    tokenizer.save_pretrained(model)
    corpus = tmp_path / "a.txt"
    corpus.write_text("w1 w2 w3")
    out = tmp_path / "store"
    assert main(["datastore", "build", "--tokenizer", str(model), "--input", str(corpus), "--out", str(out),
                 "--chat-template"]) == 0
    from hierspec.datastore.suffix import SuffixStore

    tokens = np.asarray(SuffixStore.open(out).shards[0][0]).tolist()
    assert tokens[:-1] == [60, 1, 2, 3, 61]  # the template's markup around the document, then the separator
    code, _, err = _run(capsys, "datastore", "build", "--tokenizer", model_dir,  # its tokenizer has no template
                        "--input", str(corpus), "--out", str(tmp_path / "x"), "--chat-template")
    assert code == 2 and "has no chat template" in err



@pytest.fixture(scope="module")
def model_store_dir(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompts")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"w{i} w{i + 1} w{i + 2}"]}) + "\n" for i in range(1, 9)))
    out = folder / "model-store"
    assert main(["datastore", "build", "--kind", "model", "--model", model_dir, "--prompts", str(prompts),
                 "--out", str(out), "--max-new-tokens", "8", "--limit", "6", "--l", "1", "--m", "3"]) == 0
    return str(out)


def test_model_store_build_and_info(capsys, model_store_dir):
    code, out, _ = _run(capsys, "datastore", "info", model_store_dir)
    info = json.loads(out)
    assert code == 0 and info["kind"] == "model" and info["num_prompts"] == 6
    assert info["key_len"] == 1 and info["value_len"] == 3 and info["num_grams"] > 0


def test_hd_is_the_default_method_and_matches_ar(capsys, model_dir, store_dir, model_store_dir):
    code, out, _ = _run(capsys, "generate", "w4 w5 w6 w4 w5", "--model", model_dir, "--raw", "--method", "ar",
                        "--max-new-tokens", "12", "--json")
    reference = json.loads(out)["token_ids"]
    for extra in ([], ["--datastore", store_dir, "--datastore", model_store_dir],
                  ["--method", "hd:l=1,m=3,n=2,order=smc,min_count=1", "--datastore", model_store_dir,
                   "--datastore", store_dir]):
        code, out, _ = _run(capsys, "generate", "w4 w5 w6 w4 w5", "--model", model_dir, "--raw",
                            "--max-new-tokens", "12", "--json", *extra)
        result = json.loads(out)
        assert code == 0 and result["token_ids"] == reference
        assert set(result["stats"]["drafted_by_source"]) <= {"automaton", "context", "model", "statistics",
                                                             "successors"}


def test_model_store_errors(capsys, model_dir, model_store_dir, tmp_path):
    code, _, err = _run(capsys, "datastore", "build", "--kind", "model", "--model", model_dir,
                        "--out", str(tmp_path / "x"))
    assert code == 2 and "needs --prompts" in err
    code, _, err = _run(capsys, "datastore", "build", "--kind", "model", "--model", model_dir,
                        "--prompts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "x"))
    assert code == 2 and "prompt file not found" in err
    other = _model_with_another_tokenizer(tmp_path)
    code, _, err = _run(capsys, "generate", "w1", "--model", str(other), "--raw", "--method", "hd",
                        "--datastore", model_store_dir)
    assert code == 2 and "was built with tokenizer" in err
    code, _, err = _run(capsys, "generate", "w1", "--model", model_dir, "--raw", "--method", "hd:order=cz")
    assert code == 2 and "use each of the letters" in err


def test_dense_store_from_a_model_store_and_dense_methods_match_ar(capsys, model_dir, model_store_dir, tmp_path):
    out = tmp_path / "dense"
    code, printed, _ = _run(capsys, "datastore", "build", "--kind", "dense", "--model", model_dir, "--input",
                            model_store_dir, "--out", str(out), "--pca-dim", "8", "--next-tokens", "5",
                            "--index", "flat")
    assert code == 0 and "built dense store" in printed
    code, printed, _ = _run(capsys, "datastore", "info", str(out))
    info = json.loads(printed)
    assert info["kind"] == "dense" and info["pca_dim"] == 8 and info["next_tokens"] == 5 and info["keys"] > 0
    assert info["model"]["fingerprint"] and info["sources"][0].endswith("model-store")
    code, printed, _ = _run(capsys, "generate", "w2 w3 w4", "--model", model_dir, "--raw", "--method", "ar",
                            "--max-new-tokens", "10", "--json")
    reference = json.loads(printed)["token_ids"]
    for method in ("dense", "dense:num_drafts=1,draft_len=3", "hd:order=cdm,lead=cd"):
        code, printed, _ = _run(capsys, "generate", "w2 w3 w4", "--model", model_dir, "--raw", "--method", method,
                                "--datastore", str(out), "--datastore", model_store_dir, "--max-new-tokens", "10",
                                "--json")
        result = json.loads(printed)
        assert code == 0 and result["token_ids"] == reference
        assert result["stats"]["drafter"]["dense_queries"] > 0
    code, _, err = _run(capsys, "generate", "w1", "--model", model_dir, "--raw", "--method", "dense")
    assert code == 2 and "needs a 'dense' datastore" in err
    other = _model_with_another_tokenizer(tmp_path)
    code, _, err = _run(capsys, "generate", "w1", "--model", str(other), "--raw", "--method", "dense",
                        "--datastore", str(out))
    assert code == 2 and "was built with tokenizer" in err


def test_sd_and_hsddw_from_the_command_line_match_ar(capsys, model_dir):
    outputs = set()
    for args in (["--method", "ar"], ["--method", "sd", "--draft-model", "self:1", "--self-verify"],
                 ["--method", "hsddw", "--draft-model", "self:1", "--middle-model", "self:1"]):
        code, out, _ = _run(capsys, "generate", "w5 w6 w7 w5 w6", "--model", model_dir, "--raw", "--json",
                            "--max-new-tokens", "12", *args)
        assert code == 0
        outputs.add(tuple(json.loads(out)["token_ids"]))
    assert len(outputs) == 1
    code, _, err = _run(capsys, "generate", "w1", "--model", model_dir, "--raw", "--method", "sd",
                        "--draft-model", "self:9")
    assert code == 2 and "self-drafting takes 1 to 1" in err


def test_bench_compare_and_missing_arguments(capsys, tmp_path):
    for name, speedup in (("a", 1.2), ("b", 1.4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"methods": {"pld": {
            "tokens_per_s": 10.0, "speedup": speedup, "mat": 1.5, "acceptance_rate": 0.2}}}))
    code, out, _ = _run(capsys, "bench", "--compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0 and "| pld | 10.00 | 10.00 | 1.200 | 1.400 |" in out
    code, _, err = _run(capsys, "bench", "--methods", "ar")
    assert code == 2 and "--questions and --out" in err


def test_calibrate_writes_a_curve_that_budget_auto_reads(capsys, model_dir, tmp_path):
    out = tmp_path / "curve.json"
    code, printed, _ = _run(capsys, "calibrate", "--model", model_dir, "--max-tokens", "4", "--context", "8",
                            "--repeats", "1", "--out", str(out))
    assert code == 0 and "| 4 |" in printed and out.is_file()
    saved = json.loads(out.read_text())
    assert saved["magic"] == "hierspec-cost-curve" and saved["sizes"] == [1, 2, 3, 4]
    code, _, err = _run(capsys, "calibrate", "--model", model_dir, "--repeats", "0")
    assert code == 2 and "--repeats" in err


def test_calibrate_retime_kernels_forgets_the_kept_choices_before_loading(capsys, model_dir, tmp_path, monkeypatch):
    from hierspec.runtime import prompt_kernel

    forgotten = []
    monkeypatch.setattr(prompt_kernel, "forget_choices", lambda threads: forgotten.append(threads) or [tmp_path])
    code, printed, _ = _run(capsys, "calibrate", "--model", model_dir, "--max-tokens", "2", "--context", "8",
                            "--repeats", "1", "--out", str(tmp_path / "curve.json"), "--retime-kernels")
    assert code == 0 and forgotten == [torch.get_num_threads()] and "1 kept choice(s) removed" in printed


def test_draft_head_from_a_model_store_and_hd_with_it_matches_ar(capsys, model_dir, model_store_dir, tmp_path):
    out = tmp_path / "head"
    code, printed, _ = _run(capsys, "datastore", "build", "--kind", "head", "--model", model_dir, "--input",
                            model_store_dir, "--out", str(out), "--shortlist", "16", "--head-width", "8",
                            "--epochs", "1")
    assert code == 0 and "built draft head" in printed and "held-out top-1" in printed
    code, printed, _ = _run(capsys, "datastore", "info", str(out), "--verify")
    info = json.loads(printed)
    assert info["kind"] == "head" and info["arrays"]["shortlist"]["shape"][0] <= 16 and info["verified"]["ok"]
    assert info["model"]["fingerprint"] and info["sources"][0].endswith("model-store")
    assert info["build"]["distill"] is True  # taught the target's distribution by default
    code, _, _ = _run(capsys, "datastore", "build", "--kind", "head", "--model", model_dir, "--input",
                      model_store_dir, "--out", str(tmp_path / "top1"), "--shortlist", "16", "--head-width", "8",
                      "--epochs", "1", "--head-labels", "top1")
    assert code == 0 and json.loads((tmp_path / "top1" / "header.json").read_text())["build"]["distill"] is False
    code, printed, _ = _run(capsys, "generate", "w2 w3 w4", "--model", model_dir, "--raw", "--method", "ar",
                            "--max-new-tokens", "10", "--json")
    reference = json.loads(printed)["token_ids"]
    drafted = {}
    for method in ("hd:order=hc,lead=hc,tree=fixed", "hd:order=ht,h_width=2"):
        code, printed, _ = _run(capsys, "generate", "w2 w3 w4", "--model", model_dir, "--raw", "--method", method,
                                "--datastore", str(out), "--max-new-tokens", "10", "--json")
        result = json.loads(printed)
        assert code == 0 and result["token_ids"] == reference
        drafted[method] = result["stats"]["drafted_by_source"].get("head", 0)
    assert drafted["hd:order=hc,lead=hc,tree=fixed"] > 0  # the fixed tree drafts the head's guesses every step


def test_the_method_help_names_every_registered_method_and_the_options_current_defaults(capsys):
    from hierspec.cli import build_parser
    from hierspec.drafters.draft_model import SdOptions
    from hierspec.drafters.hierarchy import HierarchyConfig
    from hierspec.drafters.registry import methods

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in methods():
        assert name in text
    assert f"hd:order={HierarchyConfig.order},m={HierarchyConfig.m}" in text and f"sd:k={SdOptions.k}" in text
