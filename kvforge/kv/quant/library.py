"""The operators of kv/ (torch.library), each defined once with its torch reference as the implementation for every
device; ops/csrc registers compiled CPU kernels for some of them when the project's kernels are built."""
from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARIES: list[torch.library.Library] = []  # kept alive: a definition lasts as long as its Library


def define(name: str, schema: str, reference: Callable) -> Callable:
    """torch.ops.kvforge.<name>, defined by `schema` with `reference` unless defined already (a second import of a
    module, e.g. after sys.modules was cleared, reuses the first definition)."""
    if not hasattr(torch.ops.kvforge, name):
        library = torch.library.Library("kvforge", "FRAGMENT")
        library.define(schema)
        library.impl(name, reference, "CompositeExplicitAutograd")
        _LIBRARIES.append(library)
    return getattr(torch.ops.kvforge, name)
