import os

import pytest
import torch

# Tests are small; one thread each avoids oversubscribing the 2-core CI machine.
torch.set_num_threads(int(os.environ.get("SPINWHEEL_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
