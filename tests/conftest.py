import sys
from pathlib import Path

import pytest
import torch

from hierspec.runtime import int4_kernel

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    # Tiny models are dominated by per-op overhead; extra threads only add contention between xdist workers.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _private_home(tmp_path_factory):
    """Tests never read or write the real home directory or user cache (default stores, cost curves, GGUF cache) —
    except the compiled int4 kernel, a build product for this CPU like numba's cache: it is loaded (built once per
    CPU, about half a minute) from the real cache before the home directory moves, not compiled again per session."""
    int4_kernel.compiled_kernel()
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
        yield home
