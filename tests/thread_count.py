"""torch's thread count set for a block of a test, then put back."""
import contextlib

import torch


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
