"""Every figure in the README and docs/ has a machine-readable source that verify recomputes.

A figure in prose carries ``<!-- src: EXPRESSION -->`` right after it (:mod:`figures.prose`);
a table carries ``<!-- from: benchmarks/results/FILE -->`` above it (:mod:`figures.pages`).
:func:`figures.prose.unsourced` lists the figures with neither; no page may have one. The test
prints every unsourced figure (``pytest -s``). A number that is not a measurement is still
sourced: a configured value by ``setting(n)`` or, where the code holds it, ``code(path, name)``.
"""

from __future__ import annotations

import pytest

from fastprefill.errors import ConfigError
from figures.prose import check_prose, code_constant, kv_cache_mb, linear_weights_gb, namespace, unsourced
from tests import REPO

RESULTS = REPO / "benchmarks" / "results"
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_has_a_source(page):
    text = (REPO / page).read_text("utf-8")
    _, claimed = check_prose(page, text, RESULTS)
    missing = unsourced(text, claimed=claimed)
    for item in missing:
        print(f"  {page}:{item}")
    assert not missing, f"{page}: {len(missing)} figures without a source:\n" + "\n".join(missing)


def test_a_source_sources_the_numbers_before_it_and_a_page_without_one_is_listed():
    text = ("Full prefill in bfloat16 is 3.82x<!-- src: cell(\"precision_qwen2.5-coder-0.5b_multidoc-qa_2048.jsonl\", "
            "\"paired speedup\", method=\"bfloat16\") --> faster, and 2.5x on code.\n")
    mismatches, claimed = check_prose("p.md", text, RESULTS)
    assert not mismatches
    assert [u.split(" (")[0] for u in unsourced(text, claimed=claimed)] == ["1: 2.5"]
    wrong, _ = check_prose("p.md", text.replace("3.82x", "3.92x"), RESULTS)
    assert [(m.committed, round(m.recomputed, 2)) for m in wrong] == [("3.92", 3.82)]


def test_a_range_a_label_and_settings():
    src = 'cell("precision_qwen2.5-coder-{m}_multidoc-qa_2048.jsonl", "paired speedup", method="bfloat16")'
    text = (f"3.8-4.2x<!-- src: ({src.format(m='0.5b')}, {src.format(m='1.5b')}) --> faster on "
            "Xeon, AMX-BF16, bfloat16<!-- src: machine(\"precision_qwen2.5-coder-0.5b_multidoc-qa_2048.jsonl\") -->; "
            "keep 80% after 20%<!-- src: setting(2) -->.\n")
    mismatches, claimed = check_prose("p.md", text, RESULTS)
    assert not mismatches and not unsourced(text, claimed=claimed)
    bad, _ = check_prose("p.md", text.replace("Xeon, AMX", "EPYC, AMX"), RESULTS)
    assert len(bad) == 1


def test_a_configured_value_is_read_from_the_code_and_checked(tmp_path):
    (tmp_path / "m.py").write_text(
        "A_S = 2.0\nB_S: float = 3.0\nSUM_S = A_S + B_S * 2\nNOT_LITERAL = len('x')\n\n"
        "class Config:\n    body_mb: float = 8.0\n\n"
        "def start(port, timeout_s=120.0, *, retries=-3):\n    pass\n")
    m = tmp_path / "m.py"
    assert code_constant(m, "A_S") == 2.0 and code_constant(m, "SUM_S") == 8.0
    assert code_constant(m, "Config.body_mb") == 8.0
    assert code_constant(m, "start.timeout_s") == 120.0 and code_constant(m, "start.retries") == -3
    for name in ("NOT_LITERAL", "MISSING", "start.port", "Config.other"):
        with pytest.raises(ConfigError):
            code_constant(m, name)
    ns = namespace(tmp_path / "benchmarks" / "results")  # code() paths are from the checkout's root
    text = 'Exit within the timeout + 8 s<!-- src: code("m.py", "SUM_S") -->.\n'
    assert check_prose("p.md", text, tmp_path, ns)[0] == []
    wrong, _ = check_prose("p.md", text.replace("+ 8 s", "+ 7 s"), tmp_path, ns)
    assert [(m.committed, m.recomputed) for m in wrong] == [("7", 8.0)]


def test_sizes_from_a_recorded_model_shape():
    shape = {"num_layers": 2, "hidden_size": 4, "num_heads": 2, "num_kv_heads": 1, "head_dim": 2,
             "intermediate_size": 8, "vocab_size": 10}
    # per layer q and o 4x4 each, k and v 4x2 each, gate, up and down 4x8 each; the LM head 4x10
    params = 2 * (2 * 16 + 2 * 8 + 3 * 32) + 40
    assert linear_weights_gb(shape) == params * 2 / 1e9
    assert linear_weights_gb(shape, bytes_per_value=4) == params * 4 / 1e9
    assert kv_cache_mb(shape, tokens=100) == 2 * 2 * 1 * 2 * 100 * 2 / 1e6
