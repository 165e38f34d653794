import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These models are tiny: a second intra-op thread buys nothing, and on shared cores it thrashes (30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
