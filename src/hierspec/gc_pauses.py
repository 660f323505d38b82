"""Keep Python's full garbage collections out of decoding.

Importing torch and transformers and loading a model leaves ~470,000 container objects that live as long as the
process. Python's cyclic collector walks all of them in every full (generation-2) collection: 0.3-0.5 s on the
project's 2-core machines, paid in the middle of some request's step (measured in continuous batching of 26 dev
requests, forty-fifth session, BENCHMARKS.md). :func:`freeze_long_lived` moves what exists after loading into the
collector's permanent generation, which it never walks; objects made later are collected as before.

Only hierspec's long-running entry points call it — the server (once its drafter has opened the stores) and the
bench (after its warm-up) — and each calls :func:`thaw` when it returns: freezing is process-wide, and a program that
runs them in-process (the tests do) gets back a collector that walks everything, so nothing it drops later stays
uncollected. The one-shot commands (``generate``, ``calibrate``, ``demo``) do not: no full collection happens in a
few generations, and the collection before freezing would cost them ~0.2 s at start. A program that imports
hierspec as a library decides for itself (it may call these functions too).
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collect once, then exempt every object that exists now from later collections; returns how many objects the
    permanent generation holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give every frozen object back to the collector (its oldest generation)."""
    gc.unfreeze()
