"""Every committed figure reproduces: ``python benchmarks/verify.py`` re-summarizes each committed
result file and finds the numbers of its committed summaries, and finds every table the README
and ``docs/results/`` quote from a result file in that file."""

from __future__ import annotations

import json
import shutil

import verify
from fastprefill.bench.records import read_rows
from figures.pages import page_sources, verify_pages
from figures.results import compare_tables, verify_results
from research.kvp import lsweep_table
from tests import REPO

RESULTS = REPO / "benchmarks" / "results"


CEILING = "lazyllm_ceiling_qwen2.5-coder-0.5b_2048"


def test_every_committed_summary_reproduces_from_its_records():
    report = verify_results(RESULTS)
    assert report.ok, "\n".join(map(str, report.mismatches))
    # serve_load, serve_runahead_load and serve_soak summaries are load rows, not bench records:
    # tests/integration/test_serve.py and test_serve_soak.py re-summarize them
    summaries = [p.name for p in RESULTS.iterdir() if p.name.endswith((".summary.jsonl", ".summary.json"))
                 and not p.name.startswith(("serve_load_", "serve_runahead_load_", "serve_soak_"))]
    assert set(summaries) <= set(report.checked)
    records_with_md = [p.name for p in RESULTS.glob("*.md") if p.with_suffix(".jsonl").exists()]
    # every committed table over records is checked, except the KV-Runahead, load (mixed too), soak and
    # kvp-prefix sweep ones (not bench records: the sweeps are checked below)
    not_records = ("runahead_", "serve_load_", "serve_mixed_", "serve_runahead_load_", "serve_soak_", "kvp_lsweep_")
    assert {m for m in records_with_md if not m.startswith(not_records)} <= set(report.checked)
    assert all(not name.startswith(("lazyllm_", "kvp_", "baseline_")) or name.startswith(not_records)
               or "no committed summary" in why for name, why in report.skipped.items())
    ceilings = [p.name for p in RESULTS.glob("lazyllm_ceiling_*.jsonl")]
    assert ceilings and set(ceilings) <= set(report.checked)


def test_committed_kvp_prefix_sweep_tables_come_from_their_rows():
    sweeps = sorted(RESULTS.glob("kvp_lsweep_*.jsonl"))
    assert sweeps
    for path in sweeps:
        header, rows = read_rows(path)
        assert rows and all(r["n"] == header["n"] for r in rows), path.name
        assert lsweep_table(header, rows) == path.with_suffix(".md").read_text(), path.name


def test_verify_finds_a_changed_figure(tmp_path):
    for stem in ("lazyllm_sweep_qwen2.5-coder-0.5b_2048", "kvp_humaneval-completion", CEILING):
        for path in RESULTS.glob(stem + ".*"):
            shutil.copy(path, tmp_path / path.name)
    assert verify_results(tmp_path).ok
    md = tmp_path / "lazyllm_sweep_qwen2.5-coder-0.5b_2048.md"
    md.write_text(md.read_text().replace("| 2.48x | 2.46x |", "| 2.48x | 2.47x |"))
    doc = json.loads((tmp_path / "kvp_humaneval-completion.summary.json").read_text())
    doc["summary"]["kvp-c"]["accuracy"] = 0.01
    (tmp_path / "kvp_humaneval-completion.summary.json").write_text(json.dumps(doc))
    rows = (tmp_path / "lazyllm_sweep_qwen2.5-coder-0.5b_2048.summary.jsonl").read_text().splitlines()
    header = json.loads(rows[0])
    header["header"]["selection"]["chosen"] = "lazyllm-aggressive"
    (tmp_path / "lazyllm_sweep_qwen2.5-coder-0.5b_2048.summary.jsonl").write_text(
        "\n".join([json.dumps(header), *rows[1:]]) + "\n")
    ceiling = tmp_path / f"{CEILING}.jsonl"
    lines = ceiling.read_text().splitlines()
    head = json.loads(lines[0])
    head["header"]["summary"][0]["first_token_agreement"] += 0.01
    ceiling.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    found = {(m.file, m.where) for m in verify_results(tmp_path).mismatches}
    assert found == {
        (f"{CEILING}.jsonl", "header.summary[0].first_token_agreement"),
        ("lazyllm_sweep_qwen2.5-coder-0.5b_2048.md", "row 2 column 'paired speedup'"),
        ("kvp_humaneval-completion.summary.json", "summary.kvp-c.accuracy"),
        ("lazyllm_sweep_qwen2.5-coder-0.5b_2048.summary.jsonl", "header.selection.chosen"),
    }


def test_tables_compare_to_the_printed_precision():
    old = "| a | b |\n|---|---|\n| 1.23x | 45% |\n"
    assert compare_tables("f", old, "| a | b | new |\n|---|---|---|\n| 1.23x | 45% | 9 |\n") == []
    assert compare_tables("f", old, "| a | b |\n|---|---|\n| 1.23x | 44% |\n")
    assert compare_tables("f", old, "| a | b |\n|---|---|\n| 1.24x | 45% |\n")
    assert compare_tables("f", old, "| a | b |\n|---|---|\n| 1.23 | 45% |\n")  # text differs
    assert compare_tables("f", old, "| a |\n|---|\n| 1.23x |\n")[0].recomputed == "(missing)"


# --------------------------------------------------------------------------- README and docs/results

def test_readme_and_docs_figures_reproduce():
    report = verify_pages(REPO)
    assert report.ok, "\n".join(map(str, report.mismatches))
    pages = sorted(p for p in (REPO / "docs" / "results").glob("*.md") if p.name != "index.md")
    assert {"README.md", *(str(p.relative_to(REPO)) for p in pages)} <= set(report.checked)
    for page in pages:  # every results page quotes its tables from result files
        assert list(page_sources(page.read_text())), f"{page.name} has no <!-- from: ... --> table"


def test_the_script_verifies_results_and_pages(capsys, tmp_path):
    assert verify.main([]) == 0
    assert capsys.readouterr().out.endswith(", 0 values differ\n")
    assert verify.main([str(tmp_path / "none")]) == 2
    assert "no such results directory" in capsys.readouterr().err


def _copy_checkout(tmp_path):
    (tmp_path / "benchmarks").symlink_to(REPO / "benchmarks")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    return tmp_path


def test_verify_pages_finds_a_changed_figure_command_path_or_link(tmp_path):
    root = _copy_checkout(tmp_path)
    page = root / "docs" / "results" / "lazyllm.md"
    text = page.read_text()
    row = "| lazyllm-four-stage | 50 | 6.737 [6.379, 7.101] | 1.66x |"
    assert row in text
    text = text.replace(row, row.replace("1.66x", "1.76x"))
    text = text.replace("--presets default --no-baselines", "--presets default")  # not a recorded command
    text = text.replace("lazyllm_keepall_smollm2-135m_2048.{jsonl,md,png}", "lazyllm_keepall_smollm2-135m_4096.jsonl")
    text = text.replace("](kv-prediction.md#lazyllm-at-the-same-flops)", "](kv-predictions.md)")
    page.write_text(text)
    found = {(m.file, m.where.split(",")[0]) for m in verify_pages(root).mismatches}
    assert found == {
        ("docs/results/lazyllm.md", "table from lazyllm_curve_default_qwen2.5-coder-0.5b_2048.jsonl"),
        ("docs/results/lazyllm.md", "command"),
        ("docs/results/lazyllm.md", "path"),
        ("docs/results/lazyllm.md", "link"),
    }


def test_a_quoted_table_must_match_its_source_by_row(tmp_path):
    root = _copy_checkout(tmp_path)
    page = root / "docs" / "results" / "prefix-cache.md"
    text = page.read_text()
    turn = "| 5 | cache | 4 | 1.145 [1.134, 2.293] | 19.66x | 100% | 100% |"
    assert turn in text  # the chat table renames `length` to `turn` in its comment
    page.write_text(text.replace(turn, turn.replace("| 5 | cache |", "| 9 | cache |")))
    found = [m for m in verify_pages(root).mismatches]
    assert [(m.file, m.committed) for m in found] == [("docs/results/prefix-cache.md", "1 row")]


def test_verify_checks_a_prefix_runs_overhead_table(tmp_path):
    stem = "prefix_questions_qwen2.5-coder-1.5b"
    for path in RESULTS.glob(stem + ".*"):
        shutil.copy(path, tmp_path / path.name)
    assert verify_results(tmp_path).ok
    md = tmp_path / f"{stem}.md"
    row = "| 2048 | cache-miss | 6 | 0 | 0.04% | 0.18% |"
    assert row in md.read_text()
    md.write_text(md.read_text().replace(row, row.replace("0.18%", "0.81%")))
    assert [(m.file, m.where) for m in verify_results(tmp_path).mismatches] == [
        (f"{stem}.md (overhead table)", "row 2 column 'store / TTFT (median)'")]


def test_verify_checks_a_tune_runs_figures_per_length_and_half(tmp_path):
    """A tune page's per-bucket table is recomputed from the run's records: a changed interval,
    or a row put in the other half, is found."""
    root = _copy_checkout(tmp_path)
    page = root / "docs" / "results" / "tune.md"
    text = page.read_text()
    row = "| 1024 | test (report) | gentle | 1.25x | 0.90 [0.74, 0.97] |"
    assert row in text
    page.write_text(text.replace(row, row.replace("0.90 [0.74, 0.97]", "0.93 [0.74, 0.97]"))
                    .replace("| 700 | dev (choose) | gentle | 1.27x |", "| 700 | test (report) | gentle | 1.27x |"))
    found = sorted((m.where.split(", row")[0], m.committed) for m in verify_pages(root).mismatches)
    source = "table from tune_qwen2.5-coder-0.5b_n30_first-token-0.7.jsonl"
    # the moved row is compared with the test half's gentle row: both its cells differ
    assert found == [(source, "0.73 [0.56, 0.86]"), (source, "0.93 [0.74, 0.97]"), (source, "1.27x")], found


def test_verify_rederives_the_anchors_summary_and_the_serve_families(tmp_path):
    """The anchors' summary.md is re-made from its run files (not read back), and a serve_mixed,
    soak, serve_load and KV-Runahead table from its rows: a changed cell in each is found."""
    shutil.copytree(RESULTS / "anchors" / "qwen2.5-coder-0.5b-no-bf16-units", tmp_path / "anchors" / "x")
    stems = ["serve_mixed_qwen2.5-coder-0.5b_quiet", "serve_soak_smollm2-135m-run2",
             "serve_load_smollm2-135m_qwen2.5-coder-0.5b", "runahead_ttft_bfloat16"]
    for stem in stems:
        for path in RESULTS.glob(stem + "*"):
            shutil.copy(path, tmp_path / path.name)
    report = verify_results(tmp_path)
    assert report.ok, report.mismatches
    assert {"anchors/x/summary.md", *(f"{s}.md" for s in stems), "serve_mixed_qwen2.5-coder-0.5b_quiet_budget.md"} <= set(report.checked)
    summary = tmp_path / "anchors" / "x" / "summary.md"
    summary.write_text(summary.read_text().replace("| 0.88 |", "| 0.86 |", 1))
    md = tmp_path / "runahead_ttft_bfloat16.md"
    md.write_text(md.read_text().replace("| 0.97x |", "| 0.99x |"))
    found = {(m.file, m.where.split(" column")[0]) for m in verify_results(tmp_path).mismatches}
    assert found == {("anchors/x/summary.md", "row 2"), ("runahead_ttft_bfloat16.md", "row 1")}, found


def test_verify_pages_finds_a_changed_prose_figure(tmp_path):
    root = _copy_checkout(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    assert "3.8-4.2x<!-- src:" in text
    readme.write_text(text.replace("3.8-4.2x<!-- src:", "3.8-4.3x<!-- src:"))
    found = [m for m in verify_pages(root).mismatches if m.file == "README.md"]
    assert [m.committed for m in found] == ["4.3"], found


def test_verify_covers_every_committed_record_file(capsys):
    """No committed record file (JSON lines) is skipped: each is re-summarized by its own family's
    check, or quoted and recomputed by a page (the tune runs, whose tables live in tune.md); the
    anchors' run files re-make their summary."""
    assert verify.main([]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out, out
    report = verify_results(RESULTS)
    covered = set(report.checked) | verify_pages(REPO).quoted
    records = {p.name for p in RESULTS.glob("*.jsonl") if not p.name.endswith(".summary.jsonl")}
    # the anchors' runs of every summary (a folder still being measured has no summary yet)
    records |= {str(p.relative_to(RESULTS)) for p in RESULTS.glob("anchors/*/run-*.jsonl")
                if (p.parent / "summary.md").exists()}
    assert records and records - covered == set(), sorted(records - covered)
