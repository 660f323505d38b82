"""The benchmark harness: every method on every question, interleaved per question in one process."""

from __future__ import annotations

import dataclasses

import datetime as dt
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hierspec.bench.metrics import MethodRecord, QuestionRun, explain_divergence, merge_turns, summarize
from hierspec.bench.plots import write_plots
from hierspec.bench.questions import Question, load_questions, select_questions
from hierspec.bench.report import write_answers, write_report
from hierspec.config import DRAFT_DTYPE, DRAFT_REQUANTIZE, DRAFT_VOCAB, GenerationConfig, ModelConfig, SamplingConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.errors import InputError
from hierspec.gc_pauses import freeze_long_lived, thaw
from hierspec.bench.peers import LLAMACPP_METHODS, LlamaCppRunner, gguf_file
from hierspec.machine import cpu_info, gpu_name
from hierspec.methods import DrafterContext, MethodSpec, make_drafter
from hierspec.target import TargetModel, load_model

log = logging.getLogger(__name__)

BASELINE = "ar"
HF_METHODS = ("hf-ar", "hf-pld", "hf-assisted")


#: the untimed warm-up's prompt: not an evaluation question, because drafters that learn across generations (the
#: successor table, earlier outputs) would otherwise have seen the first question's answer before it is timed
WARM_UP_PROMPT = "Write three sentences about the history of the bicycle."


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run.

    Attributes:
        questions: Spec-Bench-format question file.
        methods: method specs (``ar``, ``pld:max_ngram=4`` …, or ``hf-ar`` for transformers' ``generate``).
        max_new_tokens: tokens per answer.
        per_category / limit: question subset.
        out_dir: where answers, ``summary.json`` and ``report.md`` go.
        max_draft_tokens: draft budget per forward (``None``: the generation default).
        warmup: untimed generations per method before timing.
        datastores: datastore directories for the methods that use them.
        sampling: greedy (the default) or sampling settings.
        sampling_seeds: a sampling run answers every question once per seed (all methods with the same seed);
            ``summary["seeds"]`` gives each method's speedup per seed with its mean and spread.
        draft_model / middle_model / self_verify: defaults for ``sd`` and ``hsddw`` (``--draft-model`` …).
        draft_vocab: tokens a draft model's head computes (``--draft-vocab``; 0 = all).
        draft_requantize: how a draft model's GGUF weights are held (``--draft-requantize``: ``"4bit"`` or
            ``"none"``).
        draft_dtype: how a draft model runs beside the target (``--draft-dtype``;
            :func:`~hierspec.methods.draft_model_config`); ``hf-assisted`` gives transformers the draft in the
            target's dtype, as its users run it.
        first_turn_only: answer only each question's first turn (default: every turn, each later turn seeing the
            method's own earlier answers, as Spec-Bench does for MT-Bench).
        subset_seed: pick the subset at random with this seed instead of in file order.
    """

    questions: str
    methods: tuple[str, ...] = ("ar", "pld")
    max_new_tokens: int = 128
    per_category: int | None = None
    limit: int | None = None
    out_dir: str = "bench-out"
    max_draft_tokens: int | None = None
    warmup: int = 1
    datastores: tuple[str, ...] = ()
    sampling: SamplingConfig = SamplingConfig()
    draft_model: str | None = None
    middle_model: str | None = None
    self_verify: bool = False
    draft_vocab: int = DRAFT_VOCAB
    draft_requantize: str = DRAFT_REQUANTIZE
    draft_dtype: str = DRAFT_DTYPE
    first_turn_only: bool = False
    subset_seed: int | None = None
    sampling_seeds: tuple[int, ...] = (0,)


class HierspecRunner:
    """Runs a hierspec method (any drafter) on prompt ids."""

    def __init__(self, model: TargetModel, spec: MethodSpec, config: GenerationConfig,
                 context: DrafterContext) -> None:
        self.label = spec.label
        self.decoder = SpeculativeDecoder(model, make_drafter(spec, context))
        self.config = config

    def describe(self) -> dict:
        return self.decoder.drafter.describe()

    def run(self, prompt_ids: list[int], seed: int | None = None) -> QuestionRun:
        result = self.decoder.generate(prompt_ids, _with_seed(self.config, seed))
        s = result.stats
        return QuestionRun(
            token_ids=result.token_ids, text=result.text, wall_time=s.total_time, accept_lengths=s.accept_lengths,
            drafted=s.drafted_tokens, accepted=s.accepted_drafts, draft_time=s.draft_time, verify_time=s.verify_time,
            prefill_time=s.prefill_time, accepted_by_source=s.accepted_by_source, drafted_by_source=s.drafted_by_source,
            won_by_source=s.won_by_source, drafter_report=s.drafter,
        )


class HfGenerateRunner:
    """transformers' own ``model.generate`` (greedy, or sampling with the same temperature / top-p / top-k, seeded
    by ``torch.manual_seed``): ``hf-ar`` plain, ``hf-pld`` with ``prompt_lookup_num_tokens=10``, ``hf-assisted``
    with the draft model as ``assistant_model``. transformers does not report its forwards, so the peer
    speculative baselines have no MAT (their accept lengths are left empty)."""

    def __init__(self, model: TargetModel, config: GenerationConfig, label: str = "hf-ar",
                 options: dict | None = None) -> None:
        self.label = label
        self.model = model
        self.config = config
        self.options = options or {}

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], seed: int | None = None) -> QuestionRun:
        target = self.model
        input_ids = torch.tensor([prompt_ids], device=target.device)
        sampling = _with_seed(self.config, seed).sampling
        options = {"do_sample": False} if sampling.greedy else {
            "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k}  # 0 disables top-k, overriding generation_config defaults
        if not sampling.greedy:
            torch.manual_seed(sampling.seed or 0)
        with target.stock():  # transformers' generate on the model as transformers loaded it
            start = time.perf_counter()
            output = target.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=self.config.max_new_tokens,
                **options, **self.options, eos_token_id=sorted(target.eos_token_ids) or None,
                pad_token_id=target.tokenizer.pad_token_id or next(iter(target.eos_token_ids), 0),
            )
            target.synchronize()
            wall = time.perf_counter() - start
        new = output[0, len(prompt_ids):].tolist()
        steps = [1] * len(new) if not self.options else []
        return QuestionRun(token_ids=new, text=target.decode(new), wall_time=wall, accept_lengths=steps)


def _hf_runner(label: str, model: TargetModel, config: GenerationConfig, context: DrafterContext):
    if label == "hf-pld":
        return HfGenerateRunner(model, config, label, {"prompt_lookup_num_tokens": 10})
    if label == "hf-assisted":
        if not context.draft_model:
            raise InputError("hf-assisted needs a draft model: pass --draft-model (a model or self:K)")
        assistant = context.load_draft_lm(context.draft_model, label, dtype="target").model.model
        return HfGenerateRunner(model, config, label, {"assistant_model": assistant})
    return HfGenerateRunner(model, config)


def _with_seed(config: GenerationConfig, seed: int | None) -> GenerationConfig:
    if seed is None or config.sampling.greedy:
        return config
    return dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, seed=seed))


def make_runners(model: TargetModel, methods: tuple[str, ...], config: GenerationConfig,
                 context: DrafterContext | None = None) -> list:
    """One runner per method; the ``ar`` baseline is added first when missing (speedups are relative to it)."""
    context = context or DrafterContext(model)
    specs = [m.strip() for m in methods if m.strip()]
    if BASELINE not in specs:
        specs.insert(0, BASELINE)
    if len(set(specs)) != len(specs):
        raise InputError(f"a method is listed twice in {','.join(specs)}")
    runners = []
    for text in specs:
        if text in HF_METHODS:
            runners.append(_hf_runner(text, model, config, context))
        elif text in LLAMACPP_METHODS:
            runners.append(LlamaCppRunner(model, gguf_file(context.model_config), config, torch.get_num_threads(),
                                          label=text))
        else:
            runners.append(HierspecRunner(model, MethodSpec.parse(text), config, context))
    return runners


def environment(model: TargetModel) -> dict:
    """Machine, library versions and settings recorded with every run."""
    import transformers

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": cpu_info().describe(),
        "gpu": gpu_name(model.device),
        "runtime": model.runtime.describe(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(model.device),
        "dtype": str(model.dtype).replace("torch.", ""),
    }


def run_bench(config: BenchConfig, model_config: ModelConfig, model: TargetModel | None = None) -> dict:
    """Run the benchmark, write answers, ``summary.json`` and ``report.md``, and return the summary."""
    questions = select_questions(load_questions(config.questions), config.per_category, config.limit,
                                 config.subset_seed)
    sampling = config.sampling
    if not sampling.greedy:
        sampling = dataclasses.replace(sampling, seed=config.sampling_seeds[0])
    gen_config = GenerationConfig(
        max_new_tokens=config.max_new_tokens, sampling=sampling,
        **({} if config.max_draft_tokens is None else {"max_draft_tokens": config.max_draft_tokens}),
    )
    model = model or load_model(config=model_config)
    context = DrafterContext(model, config.datastores, draft_model=config.draft_model,
                             middle_model=config.middle_model, self_verify=config.self_verify,
                             draft_vocab=config.draft_vocab, draft_requantize=config.draft_requantize,
                             draft_dtype=config.draft_dtype, model_config=model_config)
    runners = make_runners(model, config.methods, gen_config, context)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    _warm_up(runners, model.encode_prompt(WARM_UP_PROMPT), config.warmup)
    seeds = (None,) if sampling.greedy else config.sampling_seeds
    freeze_long_lived()  # the model, stores and drafters, opened by the warm-up (gc_pauses.py)
    try:
        by_seed = _run_questions(runners, model, questions, seeds, config.first_turn_only)
    finally:
        thaw()
    records = _pool(by_seed)

    divergences = _explain_divergences(model, questions, records) if sampling.greedy else []
    summary = summarize(records, BASELINE, model_name=model.name, max_new_tokens=config.max_new_tokens)
    if len(seeds) > 1:
        summary["seeds"] = seed_spread(by_seed, config.max_new_tokens)
    summary.update(environment(model))
    summary["questions_file"] = str(config.questions)
    summary["num_questions"] = len(questions)
    summary["sampling"] = {**dataclasses.asdict(sampling), **({} if sampling.greedy else
                                                               {"seeds": list(config.sampling_seeds)})}
    summary["first_turn_only"] = config.first_turn_only
    summary["divergences"] = divergences
    summary["drafters"] = {r.label: r.describe() for r in runners if hasattr(r, "describe")}
    write_answers(out_dir, records, model.name)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_plots(out_dir, summary, records)
    write_report(out_dir / "report.md", summary)
    return summary


def _run_questions(runners: list, model: TargetModel, questions: list[Question], seeds: tuple,
                   first_turn_only: bool) -> dict[int | None, dict[str, MethodRecord]]:
    """Every question through every runner (each seed), the methods interleaved per question."""
    by_seed = {seed: {r.label: MethodRecord(r.label) for r in runners} for seed in seeds}
    for index, question in enumerate(tqdm(questions, desc="questions", unit="q")):
        # Rotate the order so that no method always runs first after a cold question start.
        shift = index % len(runners)
        for seed in seeds:
            for runner in runners[shift:] + runners[:shift]:
                by_seed[seed][runner.label].add(question, run_turns(runner, model, question, first_turn_only, seed))
    return by_seed


def _pool(by_seed: dict) -> dict[str, MethodRecord]:
    pooled: dict[str, MethodRecord] = {}
    for records in by_seed.values():
        for label, record in records.items():
            target = pooled.setdefault(label, MethodRecord(label))
            for question, run in zip(record.questions, record.runs):
                target.add(question, run)
    return pooled


def seed_spread(by_seed: dict, max_new_tokens: int) -> dict:
    """Speedup of every method under each seed, with mean, standard deviation, min and max over the seeds."""
    per_seed = {seed: summarize(records, BASELINE, model_name="", max_new_tokens=max_new_tokens)["methods"]
                for seed, records in by_seed.items()}
    spread = {}
    for label in next(iter(per_seed.values())):
        values = [per_seed[seed][label]["speedup"] for seed in per_seed]
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
        spread[label] = {"speedups": dict(zip(map(str, per_seed), values)), "mean": mean, "std": std,
                         "min": min(values), "max": max(values)}
    return spread


def run_turns(runner, model: TargetModel, question: Question, first_turn_only: bool = False,
              seed: int | None = None) -> QuestionRun:
    """Answer a question's turns in order; each later turn's prompt holds the earlier turns and this runner's own
    answers to them (the chat template renders the conversation)."""
    if question.raw or first_turn_only or len(question.turns) == 1:
        prompt = model.encode_prompt(question.turns[0], raw=question.raw)
        return merge_turns([runner.run(prompt, seed)], [prompt])
    messages: list[dict] = []
    runs, prompts = [], []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        prompt = model.encode_messages(messages)
        run = runner.run(prompt, seed)
        messages.append({"role": "assistant", "content": run.text})
        runs.append(run)
        prompts.append(prompt)
    return merge_turns(runs, prompts)


def _warm_up(runners: list, prompt_ids: list[int], count: int) -> None:
    for _ in range(count):
        for runner in runners:
            runner.run(prompt_ids)


def _explain_divergences(model: TargetModel, questions: list[Question], records: dict[str, MethodRecord]) -> list[dict]:
    baseline = records[BASELINE]
    found = []
    for label, record in records.items():
        if label == BASELINE or label in LLAMACPP_METHODS:  # other numerics: differences are expected, not explained
            continue
        for i, question in enumerate(questions):
            for turn, (ref, other) in enumerate(zip(baseline.runs[i].turns, record.runs[i].turns)):
                if ref["token_ids"] != other["token_ids"]:
                    found.append({"method": label, "question_id": question.question_id, "turn": turn + 1,
                                  **explain_divergence(model, ref["prompt_ids"], ref["token_ids"],
                                                       other["token_ids"])})
                    break  # later turns see different histories
    return found
