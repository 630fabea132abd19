"""A benchmark rerun with default settings never replaces a committed result file.

Every script and ``fastprefill bench`` choose their file stem with
:func:`fastprefill.bench.records.result_name`: a stem the user names (``--name``, ``--out`` to a
file, a config's ``name``) or ``--resume`` reuses a file; a default stem that exists gets
``-run2``, ``-run3``, ...
"""

from __future__ import annotations

import argparse
import json
import sys

from fastprefill.bench.records import RESULT_SUFFIXES, result_name
from fastprefill.cli import build_parser
from fastprefill.cli.bench import bench_config


def test_a_free_default_is_taken_and_a_taken_one_gets_the_next_run_number(tmp_path):
    assert result_name(tmp_path, "curve_x") == "curve_x"
    (tmp_path / "curve_x.jsonl").write_text("{}\n")
    assert result_name(tmp_path, "curve_x") == "curve_x-run2"
    (tmp_path / "curve_x-run2.summary.json").write_text("{}")  # any file of the stem takes it
    assert result_name(tmp_path, "curve_x") == "curve_x-run3"
    assert result_name(tmp_path / "missing", "curve_x") == "curve_x"


def test_every_result_suffix_takes_the_stem(tmp_path):
    for suffix in RESULT_SUFFIXES:
        (tmp_path / f"s{suffix}").write_text("")
        assert result_name(tmp_path, "s") == "s-run2", suffix
        (tmp_path / f"s{suffix}").unlink()
    (tmp_path / "s_layers.png").write_text("")  # another stem's file
    assert result_name(tmp_path, "s") == "s"


def test_a_named_stem_or_resume_reuses_the_file(tmp_path):
    (tmp_path / "curve_x.jsonl").write_text("{}\n")
    assert result_name(tmp_path, "curve_x", name="curve_x") == "curve_x"
    assert result_name(tmp_path, "curve_x", name="mine") == "mine"
    assert result_name(tmp_path, "curve_x", resume=True) == "curve_x"


def _bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_fastprefill_bench_default_name_does_not_replace_a_result(tmp_path):
    (tmp_path / "smollm2-135m_needle.jsonl").write_text("{}\n")
    out = ["--out", str(tmp_path), "--task", "needle"]
    assert bench_config(_bench_args(*out))["name"] == "smollm2-135m_needle-run2"
    assert bench_config(_bench_args(*out, "--name", "smollm2-135m_needle"))["name"] == "smollm2-135m_needle"
    assert bench_config(_bench_args(*out, "--resume"))["name"] == "smollm2-135m_needle"
    config = tmp_path / "c.toml"
    config.write_text(f'task = "needle"\nout = "{tmp_path}"\nname = "smollm2-135m_needle"\n')
    assert bench_config(_bench_args("--config", str(config)))["name"] == "smollm2-135m_needle"


def test_a_script_rerun_with_defaults_writes_a_new_file(tmp_path, capsys):
    import runahead_projection as projection
    projection.RESULTS = tmp_path
    projection.main(["--lengths", "4096"])
    first = (tmp_path / "runahead_projection.jsonl").read_text()
    projection.main(["--lengths", "4096", "--procs", "4"])
    assert (tmp_path / "runahead_projection.jsonl").read_text() == first  # untouched
    rerun = [json.loads(line) for line in (tmp_path / "runahead_projection-run2.jsonl").read_text().splitlines()]
    assert rerun and all(r["procs"] == 4 for r in rerun)
    assert (tmp_path / "runahead_projection-run2.md").exists()
    capsys.readouterr()


def test_the_command_line_names_the_installed_command_for_python_m(monkeypatch):
    from fastprefill.bench.records import command_line

    monkeypatch.setattr(sys, "argv", ["/x/src/fastprefill/cli/__main__.py", "tune", "--n", "3"])
    assert command_line() == "fastprefill tune --n 3"
    monkeypatch.setattr(sys, "argv", ["benchmarks/prefix_bench.py", "chat"])
    assert command_line() == "python benchmarks/prefix_bench.py chat"


def test_the_command_line_is_from_the_checkouts_root_wherever_it_ran(monkeypatch):
    from fastprefill.bench.records import command_line
    from tests import REPO

    monkeypatch.chdir(REPO / "benchmarks")
    monkeypatch.setattr(sys, "argv", ["packed_bench.py", "--against", "own-attention"])
    assert command_line() == "python benchmarks/packed_bench.py --against own-attention"


def test_the_command_line_quotes_what_a_shell_would_split(monkeypatch):
    import shlex

    from fastprefill.bench.records import command_line

    args = ["--settings", "last layer", "--method", "runahead(procs=2)", "lazyllm:preset=default"]
    monkeypatch.setattr(sys, "argv", ["/x/src/fastprefill/cli/__main__.py", *args])
    line = command_line()
    assert line == "fastprefill --settings 'last layer' --method 'runahead(procs=2)' lazyllm:preset=default"
    assert shlex.split(line)[1:] == args
