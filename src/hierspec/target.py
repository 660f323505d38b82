"""The target model: prompt encoding, prefill, tree-verification forward and KV-cache compaction.

The model is an unmodified Hugging Face causal LM. A draft tree is verified in one forward pass by giving the model
a 4-D boolean attention mask (each node sees the cache and its ancestors) and explicit position ids (cache length
plus depth). Afterwards only the KV entries of the accepted path are kept. How the forward runs on this device —
prepacked weights, the KV cache's buffers, bucket padding — is the :mod:`hierspec.runtime`'s business.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hierspec.chat import encode_chat
from hierspec.config import ModelConfig, check_text
from hierspec.errors import HierspecError, InputError, ModelLoadError
from hierspec.loading import gguf_source, load_pretrained, model_fingerprint, tokenizer_fingerprint
from hierspec.runtime import Runtime, RuntimeConfig, VocabHead
from hierspec.runtime.kv_cache import TreeCache
from hierspec.tree import DraftTree


@dataclass(frozen=True)
class TreeOutput:
    """What one verification forward returns.

    Attributes:
        logits: ``[n, vocab]``, row ``i`` predicting the token after node ``i``.
        hidden: last hidden state (after the final norm) of every node, ``[n, hidden]``, when asked for.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class TargetModel:
    """A loaded causal LM with its tokenizer, ready for tree verification.

    Build it with :func:`load_model` or wrap an already loaded model with ``TargetModel(model, tokenizer)``.
    One generation runs at a time per loaded model (:meth:`generating`): generations from several threads are
    serialized, never interleaved.
    """

    def __init__(self, model, tokenizer, name: str | None = None, runtime: RuntimeConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = frozenset(_eos_ids(model, tokenizer))
        self._check_cache_layout()
        self.runtime = Runtime(model, runtime)
        if self.runtime.requantized:  # another model than the file's: its cost curve and records are its own
            self.name = f"{self.name}, requantized to 4 bits"
        self._generation = threading.Lock()
        self._generating_thread: int | None = None

    # ----------------------------------------------------------------- prompts and text
    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of a prompt, wrapped in the chat template as a user turn unless ``raw``.

        Raises:
            InputError: for an empty prompt, text that is not valid UTF-8, or a prompt that leaves no room to generate
                within the model's context.
        """
        check_text(prompt, "the prompt")
        if not prompt.strip():
            raise InputError("the prompt is empty")
        if raw or not getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = self.encode_messages([{"role": "user", "content": prompt}])
        return self.check_prompt_ids(list(ids))

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat conversation with the generation prompt appended; message text never becomes
        control tokens (:func:`hierspec.chat.encode_chat`)."""
        for message in messages:
            check_text(message.get("content"), "a message's content")
        return self.check_prompt_ids(encode_chat(self.tokenizer, messages))

    def check_prompt_ids(self, ids: Sequence[int]) -> list[int]:
        """Validate prompt ids: non-empty, in the vocabulary, and shorter than the model's context."""
        ids = [int(t) for t in ids]
        if not ids:
            raise InputError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise InputError(
                f"the prompt has {len(ids)} tokens but the model's context holds {self.max_context}; "
                "shorten the prompt"
            )
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InputError(f"prompt token ids must lie in [0, {vocab})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens removed."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @functools.cached_property
    def vocab_size(self) -> int:
        """Rows of the output embedding (may exceed the tokenizer's length)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        """Hash of the tokenizer's vocabulary and special tokens: datastores built with another tokenizer differ."""
        return tokenizer_fingerprint(self.tokenizer)

    @functools.cached_property
    def model_fingerprint(self) -> str:
        """Hash of the architecture and weights: stores of hidden states built with another model differ."""
        return model_fingerprint(self.model)

    @property
    def hidden_size(self) -> int:
        """Width of the last hidden state (the LM head's input)."""
        return int(self.model.get_output_embeddings().weight.shape[1])

    # ----------------------------------------------------------------- forward passes
    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the model for one generation.

        The runtime's buffers (tree inputs, the CUDA graphs' static cache) and a decoder's drafter are shared, so
        a second thread waits here until the first generation ends. The thread that holds the model starting
        another generation (a stream left unfinished) gets an error instead of waiting for itself forever.
        """
        me = threading.get_ident()
        if self._generating_thread == me:
            raise HierspecError(f"{self.name} is already generating in this thread (an unfinished stream?); "
                                "finish or close that stream first")
        with self._generation:
            self._generating_thread = me
            try:
                yield
            finally:
                self._generating_thread = None

    def new_cache(self, capacity: int | None = None) -> TreeCache:
        """An empty KV cache for this model, with room for ``capacity`` entries before its buffers grow."""
        return self.runtime.new_cache(capacity)

    @torch.inference_mode()
    def prefill(self, cache: TreeCache, ids: Sequence[int], want_hidden: bool = False) -> torch.Tensor | None:
        """Run the model over ``ids`` to fill the cache (no logits are needed: the last prompt token is the root).

        With ``want_hidden``, return the last hidden state of the last of ``ids`` (``None`` when ``ids`` is empty).
        """
        if not ids:
            return None
        return self.runtime.prefill(cache, ids, want_hidden)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states ``[batch, length, hidden]`` of a batch of right-padded sequences, for building stores:
        on the int4 path through the runtime's own prompt reading (:meth:`~hierspec.runtime.Runtime.hidden_states`:
        the int4 model's states, which drafters read at inference, not the float32 expansion's; several times
        faster), else transformers' forward (no cache)."""
        if getattr(self.runtime, "kind", None) == "int4":
            return self.runtime.hidden_states(input_ids, attention_mask)
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=None if attention_mask is None
                         else attention_mask.to(self.device), use_cache=False, output_hidden_states=True,
                         logits_to_keep=1)
        return out.hidden_states[-1]

    def int4_kernels(self):
        """The int4 path's kernels (:class:`~hierspec.runtime.quantized.Int4Kernels`) when the model runs on it, else
        ``None`` — for hierspec's own small networks (a draft head) to use the same products."""
        runtime = self.runtime
        return runtime.int4_kernel if getattr(runtime, "kind", None) == "int4" else None

    def input_embeddings(self) -> torch.Tensor:
        """The input embedding matrix ``[vocab, hidden]``, float32 on the CPU (a draft head reads one row a step)."""
        return self.model.get_input_embeddings().weight.detach().to("cpu", torch.float32)

    def head_over(self, tokens: Sequence[int] | torch.Tensor) -> VocabHead:
        """A head computing the logits of ``tokens`` only (ids within the vocabulary), for :meth:`forward_tree`:
        a draft model reads a shortlist of likely tokens for a fraction of its whole head's cost."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.ndim != 1 or tokens.numel() == 0 or int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise InputError(f"a head's tokens must be ids below {self.vocab_size}, at least one")
        return self.runtime.head_over(tokens)

    def forward_tree(self, cache: TreeCache, tree: DraftTree, want_hidden: bool = False,
                     head: VocabHead | None = None) -> TreeOutput:
        """Verify a draft tree in one forward pass on top of the cache; with ``head`` (:meth:`head_over`), the
        logits are those of its tokens only, in its order.

        The cache grows by the tree's padded size (:meth:`hierspec.runtime.Runtime.rows_for`) until
        :meth:`keep_path` keeps the accepted entries.
        """
        self._check_tree(tree)
        logits, hidden = self.runtime.forward_tree(cache, tree, want_hidden, head)
        return TreeOutput(logits=logits, hidden=hidden)

    def forward_trees(self, caches: Sequence[TreeCache], trees: Sequence[DraftTree],
                      want_hidden: bool = False) -> list[TreeOutput]:
        """Verify several sequences' trees, each on its own cache, in one forward where the runtime can
        (:meth:`hierspec.runtime.Runtime.forward_trees`): each output equals :meth:`forward_tree` of that tree alone."""
        for tree in trees:
            self._check_tree(tree)
        return [TreeOutput(logits=logits, hidden=hidden)
                for logits, hidden in self.runtime.forward_trees(caches, trees, want_hidden)]

    def _check_tree(self, tree: DraftTree) -> None:
        if tree.size > 1 and (int(tree.tokens.min()) < 0 or int(tree.tokens.max()) >= self.vocab_size):
            raise HierspecError("a draft holds token ids outside the model's vocabulary (a corrupt datastore?)")

    @staticmethod
    def keep_path(cache: TreeCache, past: int, keep: Sequence[int]) -> None:
        """Drop the KV entries of rejected (and padding) tree nodes.

        ``past`` is the cache length before the tree forward, ``keep`` the tree node indices to keep, ascending (the
        root and the accepted path): they become the cache's entries ``past .. past + len(keep) - 1``.
        """
        cache.keep(past, keep)

    @contextlib.contextmanager
    def stock(self):
        """Run the block on the model as transformers loaded it (for transformers' own ``generate``)."""
        with self.runtime.stock():
            yield

    def synchronize(self) -> None:
        """Wait for queued device work, so that wall-clock timings are honest on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_cache_layout(self) -> None:
        cache = DynamicCache(config=self.model.config)
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:
                raise ModelLoadError(
                    f"{self.name}: cache layers of type {type(layer).__name__} (sliding-window, chunked or linear "
                    "attention) are not supported yet; hierspec needs full-attention layers to verify draft trees"
                )


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def load_model(spec: str | None = None, config: ModelConfig | None = None) -> TargetModel:
    """Load a target model by Hugging Face id, local directory or ``.gguf`` file (default: SmolLM2-135M-Instruct).

    Args:
        spec: model to load; overrides ``config.spec`` when given.
        config: dtype, device, threads and cache options.
    """
    config = config or ModelConfig()
    if spec is not None:
        config = ModelConfig(**{**config.__dict__, "spec": spec})
    model, tokenizer, name, _, _ = load_pretrained(config)
    return TargetModel(model, tokenizer, name=name, runtime=runtime_config(config, model))


def runtime_config(config: ModelConfig, model) -> RuntimeConfig:
    """The runtime a model configuration asks for: a GGUF file keeps its quantized weights unless a dtype was
    chosen explicitly (``--dtype float32`` expands them) or another runtime was named; a float32 checkpoint with
    ``requantize="4bit"`` (a draft model's) runs its own weights rounded to 4 bits."""
    gguf = gguf_source(config) if config.dtype == "auto" else None
    if gguf is None:
        return RuntimeConfig(kind=config.runtime, attention=config.attention, int4_kernel=config.int4_kernel,
                             kv_cache=config.kv_cache, dense_kernel=config.dense_kernel, requantize=config.requantize,
                             prompt_kernel=config.prompt_kernel, decoder=config.decoder)
    # transformers records the directory it loaded from: the file's converted weights, where the int4 cache goes
    # (a model built in memory records none: no cache, rather than one in the working directory)
    return RuntimeConfig(kind=config.runtime, gguf=str(gguf), gguf_cache=model.config._name_or_path or None,
                         attention=config.attention, int4_kernel=config.int4_kernel, kv_cache=config.kv_cache,
                         requantize=config.requantize, prompt_kernel=config.prompt_kernel,
                         dense_kernel=config.dense_kernel, decoder=config.decoder)
