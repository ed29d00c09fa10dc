"""Measured cells on disk (DIR/cells/*.json): a re-run with the same DIR reuses every cell whose key matches."""
from __future__ import annotations

import json
import os
from typing import Any

from kvforge.lab.cells import Cell


class CellCache:
    def __init__(self, out_dir: str, context: dict[str, Any]):
        self.dir, self.context = os.path.join(out_dir, "cells"), context
        os.makedirs(self.dir, exist_ok=True)

    def path(self, cell: Cell) -> str:
        return os.path.join(self.dir, cell.file_name(self.context))

    def get(self, cell: Cell) -> dict | None:
        """The stored record ({"result", "seconds", ...}) or None when the cell was never finished."""
        try:
            with open(self.path(cell), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and "result" in record else None

    def put(self, cell: Cell, result: dict, seconds: float) -> dict:
        record = {"kind": cell.kind, "label": cell.label, "params": cell.params, "key": cell.key(self.context),
                  "context": self.context, "seconds": seconds, "result": result}
        tmp = self.path(cell) + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, self.path(cell))  # a Ctrl-C mid-write never leaves half a record
        return record
