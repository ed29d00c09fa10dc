"""Ctrl-C goes to the main thread: worker threads started under `sigint_to_main_thread` block SIGINT."""
from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def sigint_to_main_thread():
    """Threads started inside (torch's own at import, its intra-op pool) never receive Ctrl-C, so the kernel
    delivers it to the main thread and a blocking read at the chat prompt wakes at once; otherwise a worker may
    take it and the prompt sees nothing until the next key."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
        import torch

        torch.ones(64, 64) @ torch.ones(64, 64)  # starts the intra-op pool now, under the mask
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
