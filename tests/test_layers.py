"""The floors of docs/architecture.md hold: ops/ and eval/ import nothing above them, and no subpackage (nor the
package's top level) has an import circle, function-level imports included."""
from __future__ import annotations

import pytest
from import_graph import LEAF_TYPES, MODULES, cycles, reaches_into, reaches_outside, under

ABOVE_EVAL = ("kvforge.cli", "kvforge.lab", "kvforge.advise", "kvforge.bench", "kvforge.server", "kvforge.serve_ray")
PACKAGES = sorted({m for m in MODULES if MODULES[m].name == "__init__.py"})


@pytest.mark.parametrize("name", under("kvforge.ops"))
def test_ops_imports_only_ops_kv_and_leaf_types(name):
    assert reaches_outside(name, ("kvforge.ops", "kvforge.kv", *LEAF_TYPES)) == []


@pytest.mark.parametrize("name", under("kvforge.eval"))
def test_eval_imports_nothing_above_it(name):
    assert reaches_into(name, ABOVE_EVAL) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_a_package(package):
    assert cycles(under(package)) == []


def test_the_circle_finder_finds_circles(tmp_path):
    """A loop through a function-level import is a circle too (the bench ones were)."""
    import import_graph

    a, b, c = (tmp_path / f"{n}.py" for n in "abc")
    a.write_text("from kvforge.x.b import f\n")
    b.write_text("def f():\n    from kvforge.x.a import g\n")
    c.write_text("import kvforge.x.a\n")
    saved = dict(import_graph.MODULES)
    try:
        import_graph.MODULES.update({"kvforge.x.a": a, "kvforge.x.b": b, "kvforge.x.c": c})
        assert cycles(["kvforge.x.a", "kvforge.x.b", "kvforge.x.c"]) == [["kvforge.x.a", "kvforge.x.b"]]
    finally:
        import_graph.MODULES.clear()
        import_graph.MODULES.update(saved)
