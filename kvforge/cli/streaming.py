"""Run one request and print its text as it is generated; Ctrl-C stops that answer, not the program."""
from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from kvforge.cli.signals import sigint_seen
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams
from kvforge.server.responses import ChoiceText


@dataclass
class Streamed:
    text: str  # what was shown (the whole answer unless interrupted)
    output: RequestOutput | None  # None when interrupted
    interrupted: bool


@contextmanager
def interrupt_flag():
    """While inside, Ctrl-C sets flag[0] instead of raising, so the engine is only stopped between steps."""
    flag = [False]

    def handler(signum, frame):
        sigint_seen()
        flag[0] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: Ctrl-C keeps its default meaning
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_request(engine, prompt_ids: list[int], params: SamplingParams,
                   write: Callable[[str], None] | None = None) -> Streamed:
    write = write or _write_stdout
    rid = engine.add_request(prompt_ids, params)
    shown = ChoiceText(engine.tokenizer, prompt_ids, params.stop)
    with interrupt_flag() as interrupted:
        while True:
            if interrupted[0]:
                engine.abort(rid)
                return Streamed(shown.sent, None, True)
            for out in engine.step():
                if out.request_id != rid:
                    continue
                write(shown.delta(out.new_token_ids, out.finished, out.text))
                if out.finished:
                    return Streamed(shown.sent, out, False)


def _write_stdout(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
