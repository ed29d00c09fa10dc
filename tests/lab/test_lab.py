"""`kvforge lab --quick` on a tiny model: its figures equal the single commands', the report is self-contained,
a re-run measures nothing already measured, and an interrupted run still leaves a valid report."""
import base64
import html
import io
import json
import shlex
import shutil
from html.parser import HTMLParser

import pytest
from PIL import Image

from kvforge.cli import main
from kvforge.lab import LabOptions, run_lab
from kvforge.lab import measure as lab_measure

FORMATS = ["fp16", "int8", 'int4:{"group_size": 16}']  # the tiny model's head_dim is 16


def options(model, text, out, **kw):
    return LabOptions(model=model, text=text, out=str(out), tokens=256, formats=FORMATS, progress=False, **kw)


@pytest.fixture(scope="module")
def quick(lab_model, lab_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("lab-quick")
    assert main(["lab", "--quick", "--model", lab_model, "--text", lab_text, "--out", str(out), "--tokens", "256",
                 "--formats", *FORMATS, "--no-progress"]) == 0
    return out, json.loads((out / "results.json").read_text())


def single_command(command: str, capsys) -> dict:
    """Run the command a cell says reproduces it (kvforge ... --json) and return its JSON."""
    capsys.readouterr()
    assert main(shlex.split(command)[1:]) == 0
    return json.loads(capsys.readouterr().out)


def test_quality_figures_equal_kvforge_eval_ppl(quick, capsys):
    _, res = quick
    rows = {r["label"]: r for r in res["quality"]}
    assert {"fp32", "fp16", "int8", FORMATS[2], "fp32+h2o:64", f"{FORMATS[2]}+streaming:64"} <= set(rows)
    for label in ("int8", FORMATS[2], "fp32+h2o:64", "fp32+snapkv:32", f"{FORMATS[2]}+streaming:64"):
        row, ref = rows[label], single_command(rows[label]["command"], capsys)
        assert row["ppl"] == ref["ppl"] and res["baseline"]["ppl"] == ref["ppl_baseline"]
        assert row["delta_pct"] == ref["delta_pct"] and row["peak_kv_bytes"] == ref["peak_kv_bytes"]
        assert row["kv_bytes_per_token"] == ref["kv_bytes_per_token"] and row["tokens"] == ref["tokens"] == 256
    assert rows["fp32+h2o:64"]["peak_kv_bytes"] < rows["fp32"]["peak_kv_bytes"]  # the policy really evicted
    assert rows["int8"]["kv_bytes_per_token"] < rows["fp16"]["kv_bytes_per_token"] < rows["fp32"]["kv_bytes_per_token"]
    front = [r for r in rows.values() if r["pareto"]]
    assert front and all(not (o["kv_bytes_held_per_token"] < r["kv_bytes_held_per_token"] and o["delta_pct"] <
                              r["delta_pct"]) for r in front for o in rows.values())


def test_format_passkey_long_and_advise_figures_equal_their_commands(quick, capsys):
    _, res = quick
    for spec in FORMATS:
        row, ref = res["speed"][spec], single_command(res["speed"][spec]["command"], capsys)["formats"][spec]
        for key in ("bytes_per_token", "side_bytes_per_seq", "sequences_fit", "capacity_ratio_vs_fp16"):
            assert row[key] == ref[key]
        assert row["decode_tok_s"] > 0
    g = res["passkey"]
    for i, command in enumerate(g["commands"]):
        ref = single_command(command, capsys)
        assert [ref["full"]["accuracy"][d] for d in g["depths"]] == g["full"][i]
        assert [ref["policy"]["accuracy"][d] for d in g["depths"]] == g["with_policy"][i]
    long = res["long"]
    assert long["tokens"] > res["settings"]["context"]  # past the model's context, under StreamingLLM
    ref = single_command(long["command"], capsys)
    assert ref["segments"] == long["segments"] and ref["segment_peak_kv_bytes"] == long["segment_peak_kv_bytes"]
    advise = res["advise"]
    ref = single_command(advise["command"], capsys)
    figures = lambda rows: {r["name"]: (r["ppl"], r["delta_pct"], r["peak_kv_bytes"]) for r in rows}
    assert figures(ref["rows"]) == figures(advise["rows"]) and ref["baseline"]["ppl"] == advise["baseline"]["ppl"]
    assert advise["choice"] in {r["name"] for r in advise["rows"]}
    assert {s["kind"] for s in res["skipped"]} == {"tiers"}  # a hook, noted in the report
    spec, ref = res["speculative"], single_command(res["speculative"]["command"], capsys)
    for workload, by_batch in ref["ngram"].items():
        for key, row in by_batch.items():
            mine = spec["ngram"][workload][key]
            assert row["same_output"] and mine["same_output"] and row["output_tokens"] == mine["output_tokens"]
            assert row["acceptance_rate"] == mine["acceptance_rate"]  # greedy: the same drafts are accepted


class Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sources, self.external = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.sources.append(a["src"])
        if tag in ("script", "link", "iframe") or (a.get("href") or "").startswith("http"):
            self.external.append(tag)


def embedded_images(html: str) -> list[Image.Image]:
    p = Images()
    p.feed(html)
    p.close()
    assert not p.external
    images = []
    for src in p.sources:
        head, _, data = src.partition(",")
        assert head == "data:image/png;base64"
        img = Image.open(io.BytesIO(base64.b64decode(data)))
        img.load()
        images.append(img)
    return images


def test_report_is_self_contained_and_every_plot_decodes(quick):
    out, res = quick
    images = embedded_images((out / "report.html").read_text())
    names = ["frontier", "decode_speed", "budgets", "position", "passkey", "advisor"]
    assert "Speculative decoding" in (out / "report.html").read_text() and "speculative decoding, " in \
        (out / "summary.md").read_text()
    assert len(images) == len(names) and all(i.size[0] > 200 and i.size[1] > 100 for i in images)
    for name in names:
        assert Image.open(out / "plots" / f"{name}.png").size[0] > 200
        assert (out / "plots" / f"{name}.svg").read_text().lstrip().startswith("<?xml")
    summary = (out / "summary.md").read_text()
    assert "choice: " + res["advise"]["choice"] in summary and "Pareto set" in summary


def count_measurements(monkeypatch) -> list[str]:
    measured = []
    for kind, fn in list(lab_measure.MEASURERS.items()):
        def wrapped(ctx, p, fn=fn, kind=kind):
            measured.append(kind)
            return fn(ctx, p)
        monkeypatch.setitem(lab_measure.MEASURERS, kind, wrapped)
    return measured


def test_rerun_measures_nothing_already_measured_and_only_new_cells(quick, lab_model, lab_text, tmp_path, monkeypatch):
    out = tmp_path / "lab"
    shutil.copytree(quick[0], out)
    measured = count_measurements(monkeypatch)
    run, _ = run_lab(options(lab_model, lab_text, out))
    res = json.loads((out / "results.json").read_text())
    assert measured == [] and run.measured == [] and not run.interrupted
    assert res["quality"] == quick[1]["quality"] and res["run"]["reused"] == quick[1]["run"]["measured"]
    run, _ = run_lab(options(lab_model, lab_text, out, budgets=[32, 64, 100]))  # one new budget
    assert sorted(run.measured) == ["quality: fp32+h2o:100", "quality: fp32+snapkv:100", "quality: fp32+streaming:100"]


def test_interrupted_run_leaves_a_valid_report_and_resumes(lab_model, lab_text, tmp_path, monkeypatch):
    def interrupt(ctx, p):
        raise KeyboardInterrupt

    out = tmp_path / "lab"
    monkeypatch.setitem(lab_measure.MEASURERS, "speed", interrupt)
    assert main(["lab", "--model", lab_model, "--text", lab_text, "--out", str(out), "--tokens", "256",
                 "--formats", *FORMATS, "--no-progress"]) == 130
    res = json.loads((out / "results.json").read_text())
    assert res["run"]["interrupted"] and res["speed"] == {} and res["passkey"] is None
    assert len(res["quality"]) == len(res["run"]["measured"]) > 0 and {f"speed: {f}" for f in FORMATS} <= set(res["run"]["pending"])
    assert len(embedded_images((out / "report.html").read_text())) == 2  # frontier and budgets: what finished
    assert "interrupted" in (out / "summary.md").read_text()
    monkeypatch.undo()
    measured = count_measurements(monkeypatch)
    run, _ = run_lab(options(lab_model, lab_text, out))
    assert sorted(run.measured) == sorted(res["run"]["pending"]) and "quality" not in measured


@pytest.mark.parametrize("argv, message", [
    (["--formats", "int9"], "unknown kv_cache_dtype 'int9'"),
    (["--policies", "lru"], "unknown policy 'lru'"),
    (["--budgets", "64", "256"], "budget 256 is not smaller than the 256 tokens"),
    (["--text", "/nonexistent/book.txt"], "neither a readable file nor a named text"),
    (["--text", "{binary}"], "cannot read text file"),
    (["--out", "{file}/sub"], "is not a writable folder"),
    (["--tokens", "600"], "more than the model's context of 512"),
])
def test_bad_input_is_a_clear_error_before_any_work(argv, message, lab_model, lab_text, tmp_path, monkeypatch, capsys):
    def never(ctx, p):
        raise AssertionError("a cell ran")

    for kind in lab_measure.MEASURERS:
        monkeypatch.setitem(lab_measure.MEASURERS, kind, never)
    (tmp_path / "file").write_text("")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00 not UTF-8")
    argv = [a.replace("{file}", str(tmp_path / "file")).replace("{binary}", str(tmp_path / "binary")) for a in argv]
    base = ["lab", "--model", lab_model, "--text", lab_text, "--out", str(tmp_path / "out"), "--tokens", "256",
            "--formats", *FORMATS]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_full_mode_scores_the_full_cache_beside_streaming_past_the_context(lab_model, lab_text, tmp_path, capsys):
    opts = LabOptions(model=lab_model, text=lab_text, out=str(tmp_path), mode="full", formats=["int8"],
                      policies=["streaming"], budgets=[64, 128], progress=False, methods=[])
    run_lab(opts)
    res = json.loads((tmp_path / "results.json").read_text())
    long = res["long"]
    ref = single_command(long["command"], capsys)
    assert long["tokens"] > res["settings"]["context"] and ref["segments"] == long["segments"]
    assert ref["segments_baseline"] == long["segments_baseline"] and len(long["segments_baseline"]) < len(long["segments"])
    assert [r["label"] for r in res["quality"]] == ["fp32", "int8", "fp32+streaming:64", "fp32+streaming:128",
                                                    "int8+streaming:64", "int8+streaming:128"]


def test_a_text_within_the_context_skips_the_long_cell_with_a_note(lab_model, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("A short note about caches, kept and evicted; 7 keys.\n" * 6)  # ~320 tokens < context 512
    run, _ = run_lab(LabOptions(model=lab_model, text=str(text), out=str(tmp_path / "out"), formats=["fp16"],
                                policies=["streaming"], budgets=[32, 64], progress=False))
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["long"] is None and res["settings"]["tokens"] == len(text.read_text())  # quick caps at the text
    note = next(s["note"] for s in res["skipped"] if s["kind"] == "long")
    assert "not more than the model's context of 512" in note and html.escape(note) in (tmp_path / "out" / "report.html").read_text()
    assert not run.interrupted and res["run"]["pending"] == []


def test_methods_at_shares_kept_and_the_retrieval_suite(lab_model, lab_text, tmp_path, capsys):
    """The 2025 methods at shares of the sequence kept, on perplexity and on the retrieval suite (figures equal
    kvforge eval ppl / eval retrieval), drawn on the retrieval frontier and a task x budget heat map."""
    from kvforge.lab.report import write_report
    from kvforge.lab.runner import LabRun, prepare

    model = tmp_path / "model"  # the tiny model with a 2,048-token context: a character-level case needs ~1,100
    shutil.copytree(lab_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    opts = options(str(model), lab_text, tmp_path / "out", policies=["h2o"], budgets=[64], methods=["keydiff", "kvzip"], fractions=[0.25, 0.5], retrieval=True, heatmap="kvzip")
    ctx, cells, _ = prepare(opts)
    wanted = [c for c in cells if c.kind == "retrieval"
              or (c.kind == "quality" and c.params["format"] == "fp32" and c.params["policy"] in (None, "keydiff", "kvzip"))]
    assert len(wanted) == 10  # fp32 + 4 quality cells, the full cache + 4 retrieval cells
    run = LabRun(opts.out, {c: {"result": lab_measure.run_cell(ctx, c)} for c in wanted}, wanted)
    res = write_report(run, ctx, opts)
    quality = {r["label"]: r for r in res["quality"]}
    ref = single_command(quality["fp32+kvzip:0.25"]["command"], capsys)
    assert ref["ppl"] == quality["fp32+kvzip:0.25"]["ppl"] and ref["peak_kv_bytes"] == quality["fp32+kvzip:0.25"]["peak_kv_bytes"]
    assert quality["fp32+keydiff:0.25"]["peak_kv_bytes"] < quality["fp32+keydiff:0.5"]["peak_kv_bytes"] < quality["fp32"]["peak_kv_bytes"]
    rows = {r["label"]: r for r in res["retrieval"]["rows"]}
    assert set(rows) == {"fp32", "fp32+keydiff:0.25", "fp32+keydiff:0.5", "fp32+kvzip:0.25", "fp32+kvzip:0.5"}
    ref = single_command(rows["fp32+kvzip:0.5"]["command"], capsys)
    assert ref["variants"]["fp32 kvzip 0.5"]["accuracy"] == rows["fp32+kvzip:0.5"]["accuracy"]
    assert ref["full"]["accuracy"] == rows["fp32"]["accuracy"] == res["retrieval"]["full"]["accuracy"]
    for key in ("peak_kv_bytes", "context_kv_bytes"):
        assert ref["variants"]["fp32 kvzip 0.5"][key] == rows["fp32+kvzip:0.5"][key]
    assert rows["fp32+kvzip:0.25"]["kv_fraction"] < rows["fp32+kvzip:0.5"]["kv_fraction"] < 1.0 == rows["fp32"]["kv_fraction"]
    for name in ("frontier", "retrieval_frontier", "retrieval_heatmap"):
        Image.open(tmp_path / "out" / "plots" / f"{name}.png").verify()
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Retrieval accuracy by task and budget" in page and rows["fp32+kvzip:0.5"]["command"] in html.unescape(page)
