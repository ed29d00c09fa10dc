"""kv/ is a layer of its own: any of its modules imports first in a fresh process, and none reaches up (to memcalc,
models/ or anything else but leaf types)."""
import pathlib
import subprocess
import sys

import pytest
from import_graph import LEAF_TYPES, reaches_outside, under

import kvforge

KV = pathlib.Path(kvforge.__file__).parent / "kv"
MODULES = sorted("kvforge." + ".".join(p.relative_to(KV.parent).with_suffix("").parts)
                 for p in KV.rglob("*.py") if p.name != "__init__.py")


FRESH_IMPORTS = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "kvforge" or m.startswith("kvforge.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {e!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_kv_module_imports_first():
    """Each module is imported with no kvforge module loaded yet (one interpreter, sys.modules cleared)."""
    run = subprocess.run([sys.executable, "-c", FRESH_IMPORTS, *MODULES], check=False, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("name", under("kvforge.kv"))
def test_kv_imports_nothing_above_it(name):
    assert reaches_outside(name, ("kvforge.kv", *LEAF_TYPES)) == []
