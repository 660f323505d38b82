"""Full garbage collections kept out of decoding: what loading leaves is frozen, and given back when a command ends."""

from __future__ import annotations

import gc
import weakref

import pytest


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freezing_exempts_what_exists_from_collections_until_thawed():
    from hierspec.gc_pauses import freeze_long_lived, thaw

    node = _Node()
    alive = weakref.ref(node)
    frozen = freeze_long_lived()
    assert frozen > 0 and gc.get_freeze_count() > 0  # (frozen objects may still be freed by reference counting)
    del node
    gc.collect()
    assert alive() is not None  # frozen: a full collection does not walk it
    thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # given back: collected again


def test_freezing_collects_first():
    from hierspec.gc_pauses import freeze_long_lived

    node = _Node()
    alive = weakref.ref(node)
    del node
    freeze_long_lived()
    assert alive() is None  # garbage at freezing time is not kept forever


def test_the_server_freezes_what_it_loaded_while_it_serves_and_thaws_when_it_stops(monkeypatch):
    import uvicorn

    from hierspec.drafters import NoDrafter
    from hierspec.server import ServerConfig, serve
    from tiny import make_target

    serving = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: serving.append(gc.get_freeze_count()))
    serve(make_target("llama", vocab_size=64, seed=5, max_positions=64), NoDrafter(), ServerConfig(model_name="tiny"))
    assert len(serving) == 1 and serving[0] > 0  # frozen while serving
    assert gc.get_freeze_count() == 0  # and thawed when it stopped


def test_a_one_shot_command_freezes_nothing(tmp_path, monkeypatch, capsys):
    from hierspec import gc_pauses
    from hierspec.cli import main
    from tiny import save_model_dir

    model = save_model_dir(tmp_path / "tiny", vocab_size=64, seed=5, max_positions=64)
    real, counts = gc_pauses.freeze_long_lived, []

    def freeze() -> int:
        counts.append(real())
        return counts[-1]

    monkeypatch.setattr(gc_pauses, "freeze_long_lived", freeze)
    code = main(["calibrate", "--model", str(model), "--max-tokens", "2", "--context", "8", "--repeats", "1",
                 "--out", str(tmp_path / "curve.json")])
    assert code == 0, capsys.readouterr().err
    assert counts == [] and gc.get_freeze_count() == 0  # no ~0.2 s collection at the start of a short command
