"""Engine tests run tiny matmuls: one intra-op thread is fastest and kind to the shared machine."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
