"""Cell keys and the Pareto set, without a model."""
from kvforge.lab.cells import Cell, quality_cell
from kvforge.lab.results import pareto

CONTEXT = {"model": {"path": "/m.gguf", "bytes": [100]}, "text": "ab12", "kvforge": "0.1.0"}


def test_a_cell_key_changes_with_model_text_version_and_options():
    cell = quality_cell(512, "int4", "h2o", 128)
    key = cell.key(CONTEXT)
    assert key == quality_cell(512, "int4", "h2o", 128).key(dict(CONTEXT))  # stable across processes
    changed = [{**CONTEXT, "model": {"path": "/m.gguf", "bytes": [101]}}, {**CONTEXT, "text": "ab13"},
               {**CONTEXT, "kvforge": "0.2.0"}]
    assert all(cell.key(c) != key for c in changed)
    others = [quality_cell(1024, "int4", "h2o", 128), quality_cell(512, "int4", "h2o", 64),
              quality_cell(512, "int4", "snapkv", 128), quality_cell(512, 'int4:{"group_size": 32}', "h2o", 128),
              Cell("speed", cell.label, cell.params)]
    assert len({c.key(CONTEXT) for c in others} | {key}) == len(others) + 1


def test_pareto_keeps_points_nothing_beats_on_both_axes():
    points = [(100.0, 0.0), (50.0, 0.1), (50.0, 0.5), (25.0, 3.0), (30.0, 4.0), (25.0, 3.0)]
    assert pareto(points) == [True, True, False, True, False, True]
