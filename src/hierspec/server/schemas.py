"""OpenAI request schemas (the subset hierspec serves) and their mapping to a :class:`GenerationConfig`.

Parameters that would change what the model generates in ways hierspec does not implement (``n > 1``,
``logprobs``, penalties, ``logit_bias``, ``echo``, ``suffix``, ``best_of > 1``, tools) are rejected with a 400
rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from hierspec.config import GenerationConfig, SamplingConfig
from hierspec.errors import InputError


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None)
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None
    presence_penalty: StrictFloat | StrictInt = 0
    frequency_penalty: StrictFloat | StrictInt = 0
    logprobs: StrictBool | StrictInt | None = None
    logit_bias: dict | None = None

    def check_supported(self) -> None:
        """Reject parameters hierspec cannot honour and unknown ones."""
        if self.n != 1:
            raise InputError("only n = 1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise InputError("presence_penalty and frequency_penalty are not supported")
        if self.logprobs:
            raise InputError("logprobs are not supported")
        if self.logit_bias:
            raise InputError("logit_bias is not supported")
        unknown = sorted(set(self.model_extra or {}) - set(self._ignored()))
        if unknown:
            raise InputError(f"unsupported parameter(s): {', '.join(unknown)}")

    @staticmethod
    def _ignored() -> tuple[str, ...]:
        return ()

    def generation_config(self, default_max_tokens: int) -> GenerationConfig:
        """The decoding settings of this request (temperature 0 = greedy, as in OpenAI's API)."""
        self.check_supported()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise InputError("at most 4 stop sequences are allowed")
        return GenerationConfig(
            max_new_tokens=default_max_tokens if max_tokens is None else max_tokens,
            sampling=SamplingConfig(temperature=float(self.temperature), top_p=float(self.top_p), seed=self.seed),
            stop=tuple(stop),
        )


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictStr]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InputError("echo is not supported")
        if self.suffix:
            raise InputError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise InputError("only best_of = 1 is supported")

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise InputError("prompt must be one string (batches are not supported)")
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr
    name: StrictStr | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]

    def chat_messages(self) -> list[dict]:
        if not self.messages:
            raise InputError("messages must hold at least one message")
        if not any(m.content.strip() for m in self.messages):
            raise InputError("every message is empty")
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in self.messages]
