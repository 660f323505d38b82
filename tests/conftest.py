import shutil
import sys
from pathlib import Path

import pytest
import torch

from hierspec.paths import user_cache_dir
from hierspec.runtime import int4_kernel

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    # Tiny models are dominated by per-op overhead; extra threads only add contention between xdist workers.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def kernel_builds() -> Path:
    """The real cache's directory of compiled kernels: build products for this CPU (like numba's cache), kept between
    sessions because a build takes minutes on a 2-core machine."""
    return user_cache_dir() / "kernels"


@pytest.fixture(autouse=True, scope="session")
def _private_home(tmp_path_factory, kernel_builds):
    """Tests never read or write the real home directory or user cache (default stores, cost curves, GGUF cache) —
    except the compiled int4 kernel: it is built once per CPU into the real cache before the home directory moves,
    and its build products (not this machine's timed path choices) are copied into the private cache, where the
    ``hierspec`` subprocesses of the entry-point tests load it instead of compiling it again."""
    int4_kernel.compiled_kernel()
    build = int4_kernel.build_directory()
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
        if build.is_dir():
            shutil.copytree(build, int4_kernel.build_directory(), ignore=shutil.ignore_patterns("*choice-t*.json"))
        yield home
