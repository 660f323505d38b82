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

from hierspec.bench.metrics import MethodRecord, QuestionRun, explain_divergence, summarize
from hierspec.bench.questions import Question, load_questions, select_questions
from hierspec.bench.report import write_answers, write_report
from hierspec.config import GenerationConfig, ModelConfig, SamplingConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.errors import InputError
from hierspec.methods import DrafterContext, MethodSpec, make_drafter
from hierspec.target import TargetModel, load_model

log = logging.getLogger(__name__)

BASELINE = "ar"
HF_METHODS = ("hf-ar",)


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
        sampling: greedy (the default) or sampling settings; a sampling run seeds every generation with
            ``sampling.seed`` (0 when unset) so all methods see the same random stream.
        draft_model / middle_model / self_verify: defaults for ``sd`` and ``hsddw`` (``--draft-model`` …).
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


class HierspecRunner:
    """Runs a hierspec method (any drafter) on prompt ids."""

    def __init__(self, model: TargetModel, spec: MethodSpec, config: GenerationConfig,
                 context: DrafterContext) -> None:
        self.label = spec.label
        self.decoder = SpeculativeDecoder(model, make_drafter(spec, context))
        self.config = config

    def describe(self) -> dict:
        return self.decoder.drafter.describe()

    def run(self, prompt_ids: list[int]) -> QuestionRun:
        result = self.decoder.generate(prompt_ids, self.config)
        s = result.stats
        return QuestionRun(
            token_ids=result.token_ids, text=result.text, wall_time=s.total_time, accept_lengths=s.accept_lengths,
            drafted=s.drafted_tokens, accepted=s.accepted_drafts, draft_time=s.draft_time, verify_time=s.verify_time,
            accepted_by_source=s.accepted_by_source, drafted_by_source=s.drafted_by_source,
            won_by_source=s.won_by_source, drafter_report=s.drafter,
        )


class HfGenerateRunner:
    """transformers' own ``model.generate``, the reference for hierspec's plain path (greedy, or sampling with the
    same temperature / top-p / top-k, seeded by ``torch.manual_seed``)."""

    def __init__(self, model: TargetModel, config: GenerationConfig) -> None:
        self.label = "hf-ar"
        self.model = model
        self.config = config

    @torch.inference_mode()
    def run(self, prompt_ids: list[int]) -> QuestionRun:
        target = self.model
        input_ids = torch.tensor([prompt_ids], device=target.device)
        sampling = self.config.sampling
        options = {"do_sample": False} if sampling.greedy else {
            "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k}  # 0 disables top-k, overriding generation_config defaults
        if not sampling.greedy:
            torch.manual_seed(sampling.seed or 0)
        start = time.perf_counter()
        output = target.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=self.config.max_new_tokens,
            **options, eos_token_id=sorted(target.eos_token_ids) or None,
            pad_token_id=target.tokenizer.pad_token_id or next(iter(target.eos_token_ids), 0),
        )
        target.synchronize()
        wall = time.perf_counter() - start
        new = output[0, len(prompt_ids):].tolist()
        return QuestionRun(token_ids=new, text=target.decode(new), wall_time=wall, accept_lengths=[1] * len(new))


def make_runners(model: TargetModel, methods: tuple[str, ...], config: GenerationConfig,
                 context: DrafterContext | None = None) -> list:
    """One runner per method; the ``ar`` baseline is added first when missing (speedups are relative to it)."""
    specs = [m.strip() for m in methods if m.strip()]
    if BASELINE not in specs:
        specs.insert(0, BASELINE)
    if len(set(specs)) != len(specs):
        raise InputError(f"a method is listed twice in {','.join(specs)}")
    runners = []
    for text in specs:
        if text in HF_METHODS:
            runners.append(HfGenerateRunner(model, config))
        else:
            runners.append(HierspecRunner(model, MethodSpec.parse(text), config, context or DrafterContext(model)))
    return runners


def environment(model: TargetModel) -> dict:
    """Machine, library versions and settings recorded with every run."""
    import transformers

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
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
    questions = select_questions(load_questions(config.questions), config.per_category, config.limit)
    sampling = config.sampling
    if not sampling.greedy and sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=0)
    gen_config = GenerationConfig(
        max_new_tokens=config.max_new_tokens, sampling=sampling,
        **({} if config.max_draft_tokens is None else {"max_draft_tokens": config.max_draft_tokens}),
    )
    model = model or load_model(config=model_config)
    context = DrafterContext(model, config.datastores, draft_model=config.draft_model,
                             middle_model=config.middle_model, self_verify=config.self_verify,
                             model_config=model_config)
    runners = make_runners(model, config.methods, gen_config, context)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    prompts = [model.encode_prompt(q.turns[0]) for q in questions]
    _warm_up(runners, prompts[0], config.warmup)
    records = {r.label: MethodRecord(r.label) for r in runners}
    for index, (question, prompt_ids) in enumerate(tqdm(list(zip(questions, prompts)), desc="questions", unit="q")):
        # Rotate the order so that no method always runs first after a cold question start.
        shift = index % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            records[runner.label].add(question, runner.run(prompt_ids))

    divergences = _explain_divergences(model, questions, prompts, records) if sampling.greedy else []
    summary = summarize(records, BASELINE, model_name=model.name, max_new_tokens=config.max_new_tokens)
    summary.update(environment(model))
    summary["questions_file"] = str(config.questions)
    summary["num_questions"] = len(questions)
    summary["sampling"] = dataclasses.asdict(sampling)
    summary["divergences"] = divergences
    summary["drafters"] = {r.label: r.describe() for r in runners if hasattr(r, "describe")}
    write_answers(out_dir, records, model.name)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_report(out_dir / "report.md", summary)
    return summary


def _warm_up(runners: list, prompt_ids: list[int], count: int) -> None:
    for _ in range(count):
        for runner in runners:
            runner.run(prompt_ids)


def _explain_divergences(
    model: TargetModel, questions: list[Question], prompts: list[list[int]], records: dict[str, MethodRecord]
) -> list[dict]:
    baseline = records[BASELINE]
    found = []
    for label, record in records.items():
        if label == BASELINE:
            continue
        for i, question in enumerate(questions):
            reference, other = baseline.runs[i].token_ids, record.runs[i].token_ids
            if reference != other:
                found.append({"method": label, "question_id": question.question_id,
                              **explain_divergence(model, prompts[i], reference, other)})
    return found
