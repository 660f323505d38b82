"""Which products read prompts on the int4 path (``--prompt-kernel``): the choice, its file, its refusals."""

import json
import logging

import pytest

from hierspec.config import ModelConfig
from hierspec.errors import InputError
from hierspec.runtime import RuntimeConfig, int4_kernel
from hierspec.runtime import prompt_kernel as pk
from hierspec.runtime.quantized import Int4Kernels

VNNI = Int4Kernels("vnni", "vnni")


@pytest.fixture
def choice_file(tmp_path, monkeypatch):
    """The automatic choice kept in a private file, and forgotten by the process before and after the test."""
    path = tmp_path / "kernels" / "prompt-choice-t2.json"
    monkeypatch.setattr(pk, "prompt_choice_path", lambda threads: path)
    pk.timed_prompt_choice.cache_clear()
    yield path
    pk.timed_prompt_choice.cache_clear()


def test_the_faster_prompt_products_are_chosen_and_the_expanded_ones_on_a_tie():
    assert pk.choose_prompt_kernel({"expanded": 2.0e-3, "vnni8": 1.2e-3}) == "vnni8"
    assert pk.choose_prompt_kernel({"expanded": 1.0e-3, "vnni8": 1.5e-3}) == "expanded"
    assert pk.choose_prompt_kernel({"vnni8": 1.0e-3, "expanded": 1.0e-3}) == "expanded"


def test_auto_is_timed_once_per_machine_kept_and_read_back(choice_file, monkeypatch):
    timings = []
    monkeypatch.setattr(pk, "time_prompt_products",
                        lambda: timings.append(1) or {"expanded": 3.0e-3, "vnni8": 1.0e-3})
    assert pk.resolve_prompt_kernel("auto", VNNI, threads=2) == "vnni8"
    assert pk.resolve_prompt_kernel("auto", VNNI, threads=2) == "vnni8"
    assert timings == [1]
    kept = json.loads(choice_file.read_text(encoding="utf-8"))
    assert kept["version"] == pk.CHOICE_VERSION and kept["prompt_kernel"] == "vnni8"
    assert kept["seconds"] == {"expanded": 3.0e-3, "vnni8": 1.0e-3} and kept["rows"] == pk.PROMPT_ROWS

    pk.timed_prompt_choice.cache_clear()  # another process on the same machine reads the file, times nothing
    monkeypatch.setattr(pk, "time_prompt_products", lambda: pytest.fail("timed again"))
    assert pk.resolve_prompt_kernel("auto", Int4Kernels("vnni8", "vnni8"), threads=2) == "vnni8"


@pytest.mark.parametrize("kept", ["{not json", '{"version": 0, "prompt_kernel": "vnni8"}',
                                  '{"version": 1, "prompt_kernel": "fast"}', "[]"])
def test_a_choice_file_that_cannot_be_read_is_timed_again_and_rewritten(choice_file, monkeypatch, kept):
    choice_file.parent.mkdir(parents=True)
    choice_file.write_text(kept, encoding="utf-8")
    monkeypatch.setattr(pk, "time_prompt_products", lambda: {"expanded": 1.0e-3, "vnni8": 2.0e-3})
    assert pk.resolve_prompt_kernel("auto", VNNI, threads=2) == "expanded"
    assert json.loads(choice_file.read_text(encoding="utf-8"))["prompt_kernel"] == "expanded"


def test_a_choice_that_cannot_be_kept_is_still_used_and_said_once(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory", encoding="utf-8")
    monkeypatch.setattr(pk, "prompt_choice_path", lambda threads: blocker / "prompt-choice-t2.json")
    monkeypatch.setattr(pk, "time_prompt_products", lambda: {"expanded": 3.0e-3, "vnni8": 1.0e-3})
    pk.timed_prompt_choice.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=pk.__name__):
            assert pk.resolve_prompt_kernel("auto", VNNI, threads=2) == "vnni8"
    finally:
        pk.timed_prompt_choice.cache_clear()
    assert "cannot be kept" in caplog.text and "timed again at the next load" in caplog.text


@pytest.mark.parametrize("kernel", ["torch", "compiled", "amx", "bf16"])
def test_prompts_are_read_expanded_where_trees_run_another_kernel_and_integer_prompts_are_refused_there(
        monkeypatch, kernel):
    monkeypatch.setattr(pk, "timed_prompt_choice", lambda threads: pytest.fail("timed"))
    kernels = Int4Kernels(kernel, kernel)
    assert pk.resolve_prompt_kernel("auto", kernels, threads=2) == "expanded"
    assert pk.resolve_prompt_kernel("expanded", kernels, threads=2) == "expanded"
    for integer in ("vnni", "vnni8"):
        with pytest.raises(InputError, match=f"the {kernel} kernel: use --int4-kernel vnni or vnni8"):
            pk.resolve_prompt_kernel(integer, kernels, threads=2)


def test_an_explicit_prompt_kernel_is_kept_without_timing(monkeypatch):
    monkeypatch.setattr(pk, "timed_prompt_choice", lambda threads: pytest.fail("timed"))
    for choice in ("expanded", "vnni", "vnni8"):
        assert pk.resolve_prompt_kernel(choice, VNNI, threads=2) == choice
        assert pk.resolve_prompt_kernel(choice, Int4Kernels("vnni8", "vnni8"), threads=2) == choice


def test_unknown_prompt_kernels_are_refused_by_every_config():
    for make in (RuntimeConfig, ModelConfig):
        with pytest.raises(InputError, match="unknown prompt kernel 'fast'"):
            make(prompt_kernel="fast")
    with pytest.raises(InputError, match="unknown prompt kernel"):
        pk.resolve_prompt_kernel("fast", VNNI, threads=2)


def test_both_prompt_products_are_timed_on_a_prompt_sized_block_of_rows():
    reason = int4_kernel.vnni8_reason()
    if reason:
        pytest.skip(reason)
    seconds = pk.time_prompt_products(repeats=1)
    assert set(seconds) == {"expanded", "vnni8"} and all(0 < t < 10 for t in seconds.values())


# --- short prompts: read by the tree products where ``auto`` reads prompts expanded ---------------------------------


def test_the_short_prompt_crossover_is_the_longest_length_up_to_which_the_tree_products_always_won():
    assert pk.choose_short_prompt_rows({16: (0.08, 0.17), 32: (0.10, 0.21), 64: (0.21, 0.27),
                                        128: (0.45, 0.38)}) == 64
    assert pk.choose_short_prompt_rows({16: (0.2, 0.1), 32: (0.1, 0.2)}) == 0  # lost at the shortest: never
    assert pk.choose_short_prompt_rows({32: (0.1, 0.2), 16: (0.1, 0.2), 64: (0.3, 0.3)}) == 32  # a tie is a loss
    assert pk.choose_short_prompt_rows({16: (0.1, 0.2), 32: (0.3, 0.2), 64: (0.1, 0.9)}) == 16  # no later win counts
    assert pk.choose_short_prompt_rows({}) == 0


@pytest.fixture
def short_file(tmp_path, monkeypatch):
    path = tmp_path / "kernels" / "short-prompts-k-t2.json"
    monkeypatch.setattr(pk, "short_prompt_path", lambda key, threads: path)
    return path


def test_the_crossover_is_timed_until_the_first_loss_kept_and_read_back(short_file):
    table = {16: (0.08, 0.17), 32: (0.10, 0.21), 64: (0.30, 0.27)}
    calls = []

    def time_prompt(rows, tree):
        calls.append((rows, tree))
        return table[rows][0 if tree else 1]

    assert pk.timed_short_prompt_rows("k", 2, time_prompt) == 32
    # one untimed reading each, then three interleaved pairs per length, and nothing past the first loss
    assert calls[:2] == [(16, True), (16, False)]
    assert calls[2:] == [(rows, tree) for rows in (16, 32, 64) for _ in range(3) for tree in (True, False)]
    kept = json.loads(short_file.read_text(encoding="utf-8"))
    assert kept["version"] == pk.SHORT_CHOICE_VERSION and kept["rows"] == 32
    assert kept["seconds"] == {"16": [0.08, 0.17], "32": [0.10, 0.21], "64": [0.30, 0.27]}
    # another process on this machine reads the file and times nothing
    assert pk.timed_short_prompt_rows("k", 2, lambda rows, tree: pytest.fail("timed again")) == 32


@pytest.mark.parametrize("kept", ["{not json", '{"version": 0, "rows": 64}', '{"version": 1, "rows": -1}',
                                  '{"version": 1, "rows": "64"}', '{"version": 1, "rows": true}', "[]"])
def test_a_crossover_file_that_cannot_be_read_is_timed_again_and_rewritten(short_file, kept):
    short_file.parent.mkdir(parents=True)
    short_file.write_text(kept, encoding="utf-8")
    assert pk.timed_short_prompt_rows("k", 2, lambda rows, tree: 0.1 if tree else 0.2 * (rows <= 32)) == 32
    assert json.loads(short_file.read_text(encoding="utf-8"))["rows"] == 32


def test_retiming_forgets_every_kept_choice_of_the_thread_count_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(int4_kernel, "choice_path", lambda threads: tmp_path / f"choice-t{threads}.json")
    names = ["choice-t2.json", "prompt-choice-t2.json", "short-prompts-abc-t2.json", "short-prompts-def-t2.json",
             "choice-t1.json", "prompt-choice-t1.json", "short-prompts-abc-t1.json", "kernel.so"]
    for name in names:
        (tmp_path / name).write_text("{}")
    kept = pk.kept_choices(2)
    assert sorted(p.name for p in kept) == sorted(names[:4])
    assert sorted(p.name for p in pk.forget_choices(2)) == sorted(names[:4])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[4:])
    assert pk.forget_choices(2) == []


def test_a_choice_another_process_kept_while_this_one_timed_is_the_one_both_use(choice_file, monkeypatch):
    """Two processes timing at once on a fresh machine: the one that keeps its choice first wins, and the other runs
    with that choice instead of its own (otherwise it would read prompts unlike every later process)."""
    theirs = {"version": pk.CHOICE_VERSION, "prompt_kernel": "expanded", "seconds": {"expanded": 1.0}}

    def timed_beside_another_process():
        choice_file.parent.mkdir(parents=True, exist_ok=True)
        choice_file.write_text(json.dumps(theirs), encoding="utf-8")
        return {"expanded": 3.0e-3, "vnni8": 1.0e-3}  # this process alone would pick vnni8

    monkeypatch.setattr(pk, "time_prompt_products", timed_beside_another_process)
    assert pk.resolve_prompt_kernel("auto", VNNI, threads=2) == "expanded"
    assert json.loads(choice_file.read_text(encoding="utf-8")) == theirs


def test_a_crossover_another_process_kept_while_this_one_timed_is_the_one_both_use(short_file):
    theirs = {"version": pk.SHORT_CHOICE_VERSION, "rows": 16, "seconds": {}}

    def time_prompt(rows, tree):
        short_file.parent.mkdir(parents=True, exist_ok=True)
        short_file.write_text(json.dumps(theirs), encoding="utf-8")
        return 0.1 if tree else 0.2 * (rows <= 64)  # this process alone would choose 64

    assert pk.timed_short_prompt_rows("k", 2, time_prompt) == 16
    assert json.loads(short_file.read_text(encoding="utf-8")) == theirs
