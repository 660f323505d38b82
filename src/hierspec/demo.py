"""A short side-by-side run of plain and speculative decoding, printing speedup and output identity."""

from __future__ import annotations

from typing import TextIO

from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.methods import DrafterContext, make_drafter
from hierspec.target import TargetModel

DEMO_PROMPTS = (
    "Add a docstring and type hints to this function, and return the whole function:\n\n"
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n",
    "Correct the spelling in this paragraph and repeat it: The quick brown fox jumpd over the lazy dog. "
    "The dog was not amussed, and the fox ran back into the forrest before anyone could see it.",
    "Summarize in two sentences: Speculative decoding drafts several tokens cheaply and lets the large model "
    "verify them all in a single forward pass. Because the large model keeps only the tokens it would have "
    "produced itself, the output does not change, but fewer slow forward passes are needed.",
)


def run_demo(model: TargetModel, method: str = "hd", max_new_tokens: int = 96, out: TextIO | None = None,
             context: DrafterContext | None = None) -> dict:
    """Generate each demo prompt with ``ar`` and with ``method``; print a table and return the totals.

    The drafter is built exactly as ``hierspec generate`` builds it (:func:`~hierspec.methods.make_drafter` with
    ``context``, by default the model alone with the stores found at the default place).
    """
    import sys

    out = out or sys.stdout
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    plain = SpeculativeDecoder(model, NoDrafter())
    spec = SpeculativeDecoder(model, make_drafter(method, context or DrafterContext(model)))
    # warm-ups, untimed: a first generation pays one-off costs (the drafter's stores and tables opened, first calls)
    warm_up = model.encode_prompt("Hello")
    plain.generate(warm_up, GenerationConfig(max_new_tokens=4))
    spec.generate(warm_up, GenerationConfig(max_new_tokens=4))
    totals = {"ar_tokens": 0, "ar_time": 0.0, "spec_tokens": 0, "spec_time": 0.0, "identical": 0}
    weights = model.runtime.describe()["weights"]
    print(f"model: {model.name} on {model.device} ({weights} weights)", file=out)
    print(f"{'prompt':<8}{'ar tok/s':>10}{method + ' tok/s':>14}{'speedup':>9}{'MAT':>7}  identical", file=out)
    for index, prompt in enumerate(DEMO_PROMPTS, 1):
        ids = model.encode_prompt(prompt)
        reference, result = _timed_pair(plain, spec, ids, config, spec_first=index % 2 == 0)
        same = reference.token_ids == result.token_ids
        speedup = result.stats.tokens_per_s / reference.stats.tokens_per_s
        print(f"{index:<8}{reference.stats.tokens_per_s:>10.1f}{result.stats.tokens_per_s:>14.1f}"
              f"{speedup:>9.2f}{result.stats.mean_accepted:>7.2f}  {'yes' if same else 'NO'}", file=out)
        totals["ar_tokens"] += reference.stats.new_tokens
        totals["ar_time"] += reference.stats.total_time
        totals["spec_tokens"] += result.stats.new_tokens
        totals["spec_time"] += result.stats.total_time
        totals["identical"] += same
    speedup = (totals["spec_tokens"] / totals["spec_time"]) / (totals["ar_tokens"] / totals["ar_time"])
    totals["speedup"] = speedup
    print(f"\noverall speedup of {method} over plain decoding: {speedup:.2f}x; "
          f"outputs identical on {totals['identical']}/{len(DEMO_PROMPTS)} prompts", file=out)
    print(f"last answer:\n{result.text}", file=out)
    return totals


def _timed_pair(plain: SpeculativeDecoder, spec: SpeculativeDecoder, ids: list[int], config: GenerationConfig,
                spec_first: bool) -> tuple:
    """Both decoders' results for one prompt, after an untimed one-token reading of it: a first reading pays
    one-off costs that would fall on whichever method went first (in a fresh clone's first demo ``ar`` read the
    first prompt at 58.6 tokens/s against ~100 on the others, and ``hd`` showed 1.92x there; forty-fifth session).
    The order alternates between prompts as well."""
    plain.generate(ids, GenerationConfig(max_new_tokens=1))
    if spec_first:
        result = spec.generate(ids, config)
        return plain.generate(ids, config), result
    reference = plain.generate(ids, config)
    return reference, spec.generate(ids, config)
