"""Where hierspec keeps its caches (a leaf module: the runtime and the loaders both read it)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """hierspec's cache directory under the XDG cache home (``~/.cache/hierspec`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hierspec"
