"""Ctrl-C goes to the main thread: worker threads started under `sigint_to_main_thread` block SIGINT."""
from __future__ import annotations

import os
import signal
import threading
import time
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


class SigintRelay:
    """Delivers a Ctrl-C again if the main thread's Python handler has not run shortly after it.

    readline prints its prompt and only then waits in select(); a Ctrl-C landing in between is caught by the
    C-level handler but wakes nothing, so the prompt would sit until the next key. A thread reading the signal
    wakeup fd re-sends SIGINT to the main thread until a handler says it ran (`sigint_seen`). Start it with
    SIGINT blocked (inside `sigint_to_main_thread`) so it never takes the signal itself."""

    DELAY_S = 0.2

    def __init__(self):
        self.unhandled = False
        self._resent = 0  # wakeup bytes that our own re-sends will produce
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._read_fd = read_fd
        threading.Thread(target=self._watch, name="kvforge-sigint-relay", daemon=True).start()

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while True:
            for signum in os.read(self._read_fd, 64):
                if signum != signal.SIGINT:
                    continue
                if self._resent:
                    self._resent -= 1
                    continue
                self.unhandled = True
                time.sleep(self.DELAY_S)
                while self.unhandled:
                    self._resent += 1
                    signal.pthread_kill(main, signal.SIGINT)
                    time.sleep(self.DELAY_S)


_relay: SigintRelay | None = None


def start_sigint_relay() -> None:
    global _relay
    if _relay is None and hasattr(signal, "pthread_kill"):
        _relay = SigintRelay()


def sigint_seen() -> None:
    """Called by every Ctrl-C handler: the signal reached Python, no re-send needed."""
    if _relay is not None:
        _relay.unhandled = False
