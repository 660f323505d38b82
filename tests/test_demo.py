"""The demo times both methods fairly: each prompt read once untimed first, the order alternating between prompts."""

from hierspec.config import GenerationConfig
from hierspec.demo import _timed_pair


class Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def generate(self, ids, config):
        self.calls.append((self.name, config.max_new_tokens))
        return f"{self.name} result"


def test_each_prompt_is_read_untimed_first_and_the_methods_alternate():
    calls: list = []
    plain, spec = Recorder("ar", calls), Recorder("hd", calls)
    config = GenerationConfig(max_new_tokens=16)
    assert _timed_pair(plain, spec, [1, 2, 3], config, spec_first=False) == ("ar result", "hd result")
    assert _timed_pair(plain, spec, [1, 2, 3], config, spec_first=True) == ("ar result", "hd result")
    assert calls == [("ar", 1), ("ar", 16), ("hd", 16), ("ar", 1), ("hd", 16), ("ar", 16)]
