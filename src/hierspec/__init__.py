"""hierspec: lossless speculative decoding for Hugging Face causal language models."""

from hierspec.accept import Verdict
from hierspec.api import generate, generate_batch, make_config, stream
from hierspec.batching import BatchConfig, BatchScheduler
from hierspec.config import GenerationConfig, ModelConfig, SamplingConfig
from hierspec.decode import GenerationResult, GenerationStats, GenerationStream, SpeculativeDecoder
from hierspec.drafters import Drafter, NoDrafter, PromptLookupConfig, PromptLookupDrafter
from hierspec.errors import HierspecError, InputError, ModelLoadError
from hierspec.methods import make_drafter
from hierspec.target import TargetModel, load_model
from hierspec.tree import DraftTree, build_tree

__version__ = "0.1.0"

__all__ = [
    "BatchConfig", "BatchScheduler", "DraftTree", "Drafter", "GenerationConfig", "GenerationResult",
    "GenerationStats", "GenerationStream", "HierspecError", "InputError", "ModelConfig", "ModelLoadError",
    "NoDrafter", "PromptLookupConfig", "PromptLookupDrafter", "SamplingConfig", "SpeculativeDecoder", "TargetModel",
    "Verdict", "build_tree", "generate", "generate_batch", "load_model", "make_config", "make_drafter", "stream",
]
