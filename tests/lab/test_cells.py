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


def test_panel_cells_fold_into_worst_and_mean_per_configuration():
    from kvforge.eval.texts import PANEL
    from kvforge.lab.matrix import quality_cells
    from kvforge.lab.options import LabOptions, settings_for
    from kvforge.lab.results import quality_rows

    opts = LabOptions(formats=["int8"], policies=["h2o"], budgets=[64], panel=True, methods=["kvzip"],
                      fractions=[0.25, 0.5])
    cells = quality_cells(opts, settings_for(opts, 8192, 5000))
    assert {c.params["text"] for c in cells} == set(PANEL)
    assert len(cells) == len(PANEL) * 6  # fp32, int8, fp32+h2o, fp32+kvzip at 0.25 and 0.5, int8+h2o per text
    assert {c.params["budget"] for c in cells if c.params["policy"] == "kvzip"} == {0.25, 0.5}
    assert len({c.key(CONTEXT) for c in cells}) == len(cells)
    ppl = {("fp32", "a"): 10.0, ("int8", "a"): 10.1, ("fp32", "b"): 20.0, ("int8", "b"): 20.6}
    records = {quality_cell(64, fmt, text=t): {"result": {"ppl": p, "peak_kv_bytes": 640 if fmt == "fp32" else 160,
                                                          "tokens": 64, "kv_bytes_per_token": 1}}
               for (fmt, t), p in ppl.items()}
    base, rows = quality_rows(records)
    int8 = next(r for r in rows if r["label"] == "int8")
    assert int8["worst_text"] == "b" and abs(int8["delta_pct"] - 3.0) < 1e-9
    assert abs(int8["mean_delta_pct"] - 2.0) < 1e-9 and set(int8["deltas"]) == {"a", "b"}
    assert set(base["texts"]) == {"a", "b"} and int8["kv_fraction"] == 0.25
