"""Tiny randomly initialised causal LMs and a word-level tokenizer, for fast exact tests."""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.methods import make_drafter
from hierspec.target import TargetModel
from hierspec.tree import build_tree, root_only

ARCHITECTURES = ("llama", "qwen2")


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer whose token ``i`` is the word ``w{i}``; ``w0`` doubles as end-of-sequence."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w0")
    return tokenizer


def make_model(arch: str = "llama", vocab_size: int = 64, seed: int = 0, dtype=torch.float64,
               layers: int = 2, hidden: int = 32, max_positions: int = 512, init_std: float = 0.5):
    """A tiny model with random weights; a large ``init_std`` gives peaked, input-dependent distributions."""
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=init_std, eos_token_id=0, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


def save_model_dir(directory, arch: str = "llama", vocab_size: int = 64, seed: int = 0, dtype=torch.float64,
                   **kwargs):
    """Save a tiny model and its matching tokenizer as a Hugging Face model directory; returns ``directory``."""
    make_model(arch, vocab_size, seed, dtype, **kwargs).save_pretrained(directory)
    make_tokenizer(vocab_size).save_pretrained(directory)
    return directory


def make_target(arch: str = "llama", vocab_size: int = 64, seed: int = 0, dtype=torch.float64, **kwargs) -> TargetModel:
    """A :class:`TargetModel` around a tiny random model."""
    return TargetModel(make_model(arch, vocab_size, seed, dtype, **kwargs), make_tokenizer(vocab_size),
                       name=f"tiny-{arch}")


def assert_chain_equals_steps(target: TargetModel, prompt: list[int], chain: list[int]) -> None:
    """A drafted chain verified in one forward gives, node for node, exactly the logits of plain decoding steps over
    the same tokens."""
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    # a copy: on CUDA graphs the next replay of the same bucket overwrites a forward's logits
    tree_logits = target.forward_tree(cache, build_tree(prompt[-1], [chain])).logits.clone()
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    for node, token in enumerate([prompt[-1], *chain]):
        past = cache.get_seq_length()
        step = target.forward_tree(cache, root_only(token)).logits[0]
        target.keep_path(cache, past, [0])
        assert torch.equal(step, tree_logits[node]), f"node {node}"


def assert_tree_rows_equal_chains(target: TargetModel, trees: int = 6, seed: int = 3) -> None:
    """Random branching trees over a 60-token prompt: every node's logits equal, bit for bit, the last row of its
    root-to-node path verified alone as a chain (which ``assert_chain_equals_steps`` ties to plain decoding)."""
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    prompt = [int(t) for t in rng.integers(1, vocab, size=60)]
    branched = 0
    for _ in range(trees):
        sequences = [[int(t) for t in rng.integers(1, vocab, size=int(rng.integers(1, 7)))] for _ in range(5)]
        for sequence in sequences[1:]:  # share a random prefix with the first sequence, then branch off
            shared = min(int(rng.integers(0, 3)), len(sequence) - 1)
            sequence[:shared] = sequences[0][:shared]
        tree = build_tree(prompt[-1], sequences)
        branched += int(np.bincount(tree.parents[1:]).max() > 1)
        cache = target.new_cache()
        target.prefill(cache, prompt[:-1])
        logits = target.forward_tree(cache, tree).logits.clone()  # graphs overwrite it on the next replay
        for node in range(tree.size):
            drafts = tree.sequence(node)
            cache = target.new_cache()
            target.prefill(cache, prompt[:-1])
            chain = build_tree(prompt[-1], [drafts]) if drafts else root_only(prompt[-1])
            assert torch.equal(target.forward_tree(cache, chain).logits[-1], logits[node]), f"node {node}"
    assert branched == trees


def assert_graphed_rows_exact(target: TargetModel, chain_lengths=(1, 4, 9), trees: int = 3, seed: int = 2) -> None:
    """Chains of ``chain_lengths`` tokens over a 40-token prompt give plain decoding's logits, and every node of
    ``trees`` branching trees its chain's (a static path's row invariance, on tiny models)."""
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    prompt, chain = rng.integers(1, vocab, size=40).tolist(), rng.integers(1, vocab, size=max(chain_lengths)).tolist()
    for length in chain_lengths:
        assert_chain_equals_steps(target, prompt, chain[:length])
    assert_tree_rows_equal_chains(target, trees=trees)


def motif_prompts(vocab_size: int, count: int = 3, seed: int = 1) -> list[list[int]]:
    """Prompts that repeat a 5-token motif three times, then three random tokens and the motif's start: every
    drafter finds something to draft."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        motif = rng.integers(1, vocab_size, size=5).tolist()
        prompts.append(motif * 3 + rng.integers(1, vocab_size, size=3).tolist() + motif[:2])
    return prompts


def accepted_drafts_of_methods_equal_to_plain(target: TargetModel, prompts, methods, config,
                                              plain_target: TargetModel | None = None, extend: int = 12) -> int:
    """Assert every method's tokens on ``target`` equal plain decoding's (on ``plain_target``, by default the same
    model) for each prompt, first extended by ``extend`` of the model's own tokens (for the drafters to find);
    return the draft tokens accepted in all, so a test can check that the drafters drafted."""
    plain = SpeculativeDecoder(plain_target or target, NoDrafter())
    accepted = 0
    for prompt in prompts:
        prompt = list(prompt) + plain.generate(prompt, config).token_ids[:extend]
        reference = plain.generate(prompt, config).token_ids
        for method in methods:
            result = SpeculativeDecoder(target, make_drafter(method, target)).generate(prompt, config)
            assert result.token_ids == reference, method
            accepted += result.stats.accepted_drafts
    return accepted
