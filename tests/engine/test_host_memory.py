"""Freed host memory stays in the process (glibc), so per-step temporaries do not fault in anew."""
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, torch
from kvforge.engine.host_memory import keep_freed_memory
kept = keep_freed_memory()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
x = torch.empty(50_000_000, dtype=torch.uint8)
x.fill_(1)
del x
print(kept, libc.mallinfo2().fordblks)
"""


def probe(setting: str) -> tuple[bool, int]:
    env = {**os.environ, "KVFORGE_KEEP_FREED_MEMORY": setting}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    kept, free_bytes = out.split()
    return kept == "True", int(free_bytes)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_freed_temporaries_stay_in_the_heap_unless_opted_out():
    kept, free_bytes = probe("1")
    assert kept and free_bytes >= 50_000_000
    kept, free_bytes = probe("0")
    assert not kept and free_bytes < 50_000_000


TRIM_PROBE = """
import torch
from kvforge.engine.host_memory import keep_freed_memory, release_freed_memory
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
keep_freed_memory()
x = torch.empty(50_000_000, dtype=torch.uint8)
x.fill_(1)
del x
kept = rss()
print(release_freed_memory(), kept - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_an_engine_build_hands_freed_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True).stdout
    trimmed, returned = out.split()
    assert trimmed == "True" and int(returned) > 40_000_000
