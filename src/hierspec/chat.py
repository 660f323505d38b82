"""Chat messages to token ids, without letting message text become control tokens.

A chat template renders messages into one string that a tokenizer then splits, parsing the template's own markup
(``<|im_start|>``, ``<|im_end|>``…) into special tokens — and, by the same rule, any such markup a user typed inside a
message: a client could close its own turn and forge a system turn. :func:`encode_chat` renders the template as
usual but tokenizes each message's content with special tokens split into plain text. Content holding no special
token's text is tokenized exactly as before (the common case costs one substring scan).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hierspec.errors import InputError

#: stands in for a message's content while the template is rendered (private-use characters no template emits)
_SENTINEL = "\ue000hierspec-content-{}\ue001"


@functools.lru_cache(maxsize=8)
def special_token_texts(tokenizer) -> tuple[str, ...]:
    """The text of every special token the tokenizer parses (its control tokens)."""
    texts = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return tuple(sorted(t for t in texts if t))


def encode_chat(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template with the generation prompt appended; special
    tokens come only from the template, never from message content."""
    specials = special_token_texts(tokenizer)
    if not any(text in message["content"] for message in messages for text in specials):
        encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(t) for t in (ids[0] if ids and isinstance(ids[0], list) else ids)]
    stand_ins = [{**message, "content": _SENTINEL.format(i)} for i, message in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(stand_ins, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    for i, message in enumerate(messages):
        before, found, rendered = rendered.partition(_SENTINEL.format(i))
        if not found or _SENTINEL.format(i) in rendered:
            raise InputError("this model's chat template rewrites message content, so content holding special-token "
                             "text cannot be encoded safely; remove the special-token text from the messages")
        ids += tokenizer(before, add_special_tokens=False)["input_ids"]
        ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids += tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]
