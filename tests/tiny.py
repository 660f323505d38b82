"""Tiny randomly initialised causal LMs and a word-level tokenizer, for fast exact tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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
    tree_logits = target.forward_tree(cache, build_tree(prompt[-1], [chain])).logits
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    for node, token in enumerate([prompt[-1], *chain]):
        past = cache.get_seq_length()
        step = target.forward_tree(cache, root_only(token)).logits[0]
        target.keep_path(cache, past, [0])
        assert torch.equal(step, tree_logits[node]), f"node {node}"
