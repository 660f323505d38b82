import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    # Tiny models are dominated by per-op overhead; extra threads only add contention between xdist workers.
    torch.set_num_threads(1)
