"""Which seams fail (research/seams.py): the binning and pooling against hand-computed values, the
kept K/V through the engine on the tiny models, and the gate's seam tables re-made by verify."""

from __future__ import annotations

import json

import pytest
import torch

from blend_gate import summarize_gate, table
from fastprefill.bench.records import FULL, Record
from fastprefill.bench.runner import PromptSample, Unscored, run_samples
from fastprefill.chunk_store import ChunkStore
from fastprefill.engine import generate
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.research.blend import Blend
from fastprefill.prompt import ChunkedPrompt
from figures.pages import result_tables
from figures.results import verify_results
from research.seams import (
    GOLD_GROUPS,
    SeamPrompt,
    SeamRecorder,
    agreement_by_gold,
    gold_group,
    offset_labels,
    seam_stats,
    seam_summary,
    token_errors,
)

CHUNKS = ((2, 6), (7, 17))  # a 20-token prompt: lead 2, passage 1, glue 1, passage 2, question 3
N, LAYERS = 20, 3


def _errors() -> torch.Tensor:
    """``(2, 3, 20)``: key error ``t + layer`` (mean over layers ``t + 1``), value error ``2 t``."""
    t = torch.arange(N, dtype=torch.float32)
    return torch.stack([torch.stack([t + layer for layer in range(LAYERS)]), torch.stack([2 * t] * LAYERS)])


def test_offset_labels():
    assert offset_labels([0, 1, 4, 16, 64]) == ["0", "1-3", "4-15", "16-63", "64+"]
    assert offset_labels([0, 2]) == ["0-1", "2+"]


def test_token_errors_are_relative_l2_over_heads_and_channels():
    ref = [(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4)) for _ in range(2)]
    other = [(k.clone(), v.clone()) for k, v in ref]
    other[0][0][0, :, 2] += 1.0  # layer 0, token 2's keys: off by their own norm
    other[1] = (other[1][0], 2 * other[1][1])  # layer 1's values: twice full's
    longer = [(torch.cat([k, k[:, :, :3]], 2), torch.cat([v, v[:, :, :3]], 2)) for k, v in other]  # decoded on
    errors = token_errors(ref, longer, 5)
    assert errors.shape == (2, 2, 5)
    expected = torch.zeros(2, 2, 5)
    expected[0, 0, 2] = 1.0
    expected[1, 1] = 1.0
    assert torch.allclose(errors, expected)


def test_seam_stats_bins_by_offset_passage_glue_question_and_layer():
    stats = seam_stats(_errors(), CHUNKS, [False, True])
    # only passage 2 (positions 7..16, offsets 0..9) moved: offset 0 is position 7, 1-3 are 8..10, 4-15 are 11..16
    assert stats["offset"] == {"tokens": [1, 3, 6, 0, 0], "k": [8.0, 10.0, 14.5, None, None],
                               "v": [14.0, 18.0, 27.0, None, None]}
    assert sum(stats["offset"]["tokens"]) == CHUNKS[1][1] - CHUNKS[1][0]
    assert stats["passage"] == {"tokens": [4, 10], "k": [4.5, 12.5], "v": [7.0, 23.0], "moved": [False, True]}
    assert stats["glue"] == {"tokens": 1, "k": 7.0, "v": 12.0}
    assert stats["question"] == {"tokens": 3, "k": 19.0, "v": 36.0}
    assert stats["layers"] == {"index": [0, 1, 2], "k": [11.5, 12.5, 13.5], "v": [23.0, 23.0, 23.0]}
    assert json.loads(json.dumps(stats)) == stats  # what a record keeps


def test_seam_summary_pools_token_weighted_and_splits_gold_from_other():
    first = seam_stats(_errors(), CHUNKS, [False, True])
    second = seam_stats(2 * _errors(), ((1, 5), (5, 10), (12, 15)), [True, True, True])
    pooled = seam_summary([first, second], [[2], [1, 3]])
    # offset 0: position 7 (k 8) of the first; positions 1, 5, 12 (k 2(t+1): 4, 12, 26) of the second
    assert pooled["offset"]["tokens"][0] == 4 and pooled["offset"]["k"][0] == pytest.approx((8 + 4 + 12 + 26) / 4)
    assert sum(pooled["offset"]["tokens"]) == 10 + 12
    # gold: the first's passage 2 (10 tokens, k 12.5), the second's passages 1 and 3 (4 tokens at
    # k 2(2.5+1) = 7, 3 at k 2(13+1) = 28); other: the second's passage 2 (5 tokens, k 2(7+1) = 16)
    assert pooled["gold"]["tokens"] == 17 and pooled["gold"]["k"] == pytest.approx((10 * 12.5 + 4 * 7 + 3 * 28) / 17)
    assert pooled["other"] == {"tokens": 5, "k": pytest.approx(16.0), "v": pytest.approx(2 * 2 * 7.0)}
    assert pooled["passage"]["prompts"] == [2, 2, 1] and pooled["passage"]["tokens"] == [8, 15, 3]
    # layer 0's key error of the second is 2t over its moved positions 1..4, 5..9, 12..14 (mean 7)
    assert pooled["layers"]["k"][0] == pytest.approx((10 * 11.5 + 12 * 14.0) / 22)
    assert pooled["prompts"] == 2 and pooled["edges"] == [0, 1, 4, 16, 64]
    with pytest.raises(ValueError, match="edges"):
        seam_summary([first, {**second, "edges": [0, 2]}], [[2], [1]])


def _record(method: str, sample: str, first_token: int, **extra) -> Record:
    return Record(method=method, length=20, sample_id=sample, prompt_tokens=20, ttft_s=1.0, decode_s_per_token=0.1,
                  total_s=1.5, new_tokens=2, token_layer_fraction=1.0, prefill_flops=1.0, peak_mem_mb=1.0, score=0.5,
                  metrics={"score": 0.5}, output="x", extra={"first_token": first_token, **extra})


def test_gold_groups_and_agreement_by_them():
    assert gold_group([1, 7], 15) == "1st half" and gold_group([7, 8], 15) == "both halves"
    assert gold_group([8, 15], 15) == "2nd half" and gold_group([], 15) is None
    assert gold_group([2, 3], 4) == "both halves" and gold_group([1, 2], 4) == "1st half"
    pairs = [(_record(FULL, s, 1), _record("m", s, tok, gold_passages=gold, passages=10))
             for s, tok, gold in [("a", 1, [1, 2]), ("b", 2, [1, 3]), ("c", 1, [9, 10]), ("d", 1, [2, 9])]]
    pairs.append((_record(FULL, "e", 1), _record("m", "e", 1)))  # no gold passages: not counted
    assert agreement_by_gold(pairs) == {"1st half": [1, 2], "both halves": [1, 1], "2nd half": [1, 1]}
    assert list(agreement_by_gold(pairs)) == list(GOLD_GROUPS)


# --------------------------------------------------------------------------- through the engine

LEAD, GLUE, QUESTION = [3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15]


def _passages(make_ids) -> list[list[int]]:
    ids = make_ids(45, 11)[0].tolist()
    return [ids[:15], ids[15:32], ids[32:]]


def _prompt(passages: list[list[int]], order: list[int]) -> ChunkedPrompt:
    ids, chunks = list(LEAD), []
    for k, i in enumerate(order):
        ids += GLUE if k else []
        chunks.append((len(ids), len(ids) + len(passages[i])))
        ids += passages[i]
    return ChunkedPrompt(tuple(ids + QUESTION), tuple(chunks))


def test_a_kept_cache_is_the_prefill_cache_after_decoding(tiny_qwen2, make_ids):
    passages = _passages(make_ids)
    prompt = _prompt(passages, [2, 0, 1])
    recorder = SeamRecorder({})
    full = recorder.full()
    generate(tiny_qwen2, None, prompt, full, max_new_tokens=4, stop_at_eos=False)
    with torch.inference_mode():
        ref = FullPrefill().prefill(tiny_qwen2, torch.tensor([prompt.ids])).cache
    kept = full.sink.take(prompt.ids)
    assert kept is not None and full.sink.take(prompt.ids[:-1]) is None
    assert all(k.shape[2] == len(prompt.ids) for k, _ in kept)
    assert float(token_errors([(ref.layers[i].keys, ref.layers[i].values) for i in range(len(kept))],
                              kept, len(prompt.ids)).max()) <= 1e-5
    method = recorder.blend("b", budget=0.5, store=ChunkStore(1 << 24)).with_chunks(prompt.chunks)
    assert method.sink is recorder.sinks["b"] and method.describe() == Blend(budget=0.5).describe()


def test_the_gate_records_seams_floor_wrong_at_moved_passages_full_recompute_right(tiny_qwen2, make_ids):
    passages = _passages(make_ids)
    store = ChunkStore(1 << 24)
    generate(tiny_qwen2, None, _prompt(passages, [0, 1, 2]), Blend(budget=0.0, store=store), max_new_tokens=1)
    prompts = {"x": _prompt(passages, [2, 0, 1]), "y": _prompt(passages, [1, 2, 0])}
    recorder = SeamRecorder({k: SeamPrompt(p.ids, p.chunks, (2,)) for k, p in prompts.items()})
    methods = {FULL: recorder.full(), "floor": recorder.blend("floor", budget=0.0, store=store),
               "all": recorder.blend("all", budget=1.0, store=store),
               "head": recorder.blend("head", policy="head", budget=0.3, store=store)}
    records = run_samples(tiny_qwen2, None, Unscored(), [PromptSample(k, p) for k, p in prompts.items()], methods,
                          length=None, max_new_tokens=2, progress=False, on_record=recorder.annotate,
                          stop_at_eos=False)
    assert len(records) == 8 and all(r.extra["gold_passages"] == [2] and r.extra["passages"] == 3 for r in records)
    seams = {(r.sample_id, r.method): r.extra.get("seam") for r in records}
    assert all(seams[k, FULL] is None for k in prompts) and all(v is not None for (_, m), v in seams.items() if m != FULL)
    for sample in prompts:
        floor, everything = seams[sample, "floor"], seams[sample, "all"]
        assert floor["passage"]["moved"] == [False, True, True]  # the first sits where it was computed
        assert sum(floor["offset"]["tokens"]) == sum(floor["passage"]["tokens"][1:])
        assert max(floor["passage"]["k"][0], floor["passage"]["v"][0]) <= 1e-4
        assert min(floor["offset"]["k"][:3] + floor["offset"]["v"][:3]) > 1e-3  # the seams are off
        assert max(floor["layers"]["k"][1:]) > 1e-3 and floor["question"]["k"] > 1e-3
        worst = max(x for part in ("offset", "passage") for key in ("k", "v") for x in everything[part][key] if x)
        assert worst <= 1e-4 and everything["question"]["k"] <= 1e-4
        head = seams[sample, "head"]
        assert head["offset"]["k"][0] < floor["offset"]["k"][0]  # the recomputed offset-0 tokens are nearer
    assert not recorder.sinks["floor"].kv  # let go once recorded


def test_the_gate_tables_with_seams_verify_from_a_second_run_file(tmp_path):
    gold_of = {"a": [1, 2], "b": [2, 4], "c": [3, 4]}
    records = []
    for i, (sample, gold) in enumerate(gold_of.items()):
        records.append(_record(FULL, sample, 1, gold_passages=gold, passages=4))
        stats = seam_stats((i + 1) * _errors(), ((2, 4), (4, 8), (9, 12), (12, 17)), [False, True, True, True])
        records.append(_record("blend-floor", sample, 1 + i % 2, gold_passages=gold, passages=4,
                               seam={**stats, "seconds": 0.01}, chunk_hits=4, chunks=4))
        records.append(_record("lazyllm-x", sample, 1, gold_passages=gold, passages=4))
    header = {"bench": "blend-gate", "task": "multidoc-qa", "split": "dev", "length": 20, "n": 3,
              "model": "m", "dtype": "float32"}
    stem = tmp_path / "blend_gate_m_20_float32-run2"
    stem.with_suffix(".jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"header": header}, *(r.__dict__ for r in records)]) + "\n")
    rows = summarize_gate(records)
    stem.with_suffix(".summary.jsonl").write_text("\n".join(json.dumps(x) for x in [{"header": header}, *rows]) + "\n")
    text = table(rows, header)
    (tmp_path / (stem.name + ".md")).write_text(text)
    # of 4 passages, a's gold sit in the 1st half, b's in both, c's in the 2nd; the floor misses b only
    assert "| blend-floor | 1.00 (1/1) | 0.00 (0/1) | 1.00 (1/1) |" in text
    assert "| lazyllm-x | 1.00 (1/1) | 1.00 (1/1) | 1.00 (1/1) |" in text
    report = verify_results(tmp_path)
    assert report.ok and f"{stem.name}.md" in report.checked, report.mismatches
    tables = result_tables(tmp_path, stem.name + ".jsonl")
    assert len(tables) == 5 and tables[1][0]["method"] == "blend-floor" and tables[3][0]["passage"] == "1"
    md = tmp_path / (stem.name + ".md")
    md.write_text(text.replace("| 1 | 3 |", "| 1 | 4 |"))
    found = {(m.file, m.where) for m in verify_results(tmp_path).mismatches}
    assert found == {(md.name + " (table 4)", "row 1 column 'prompts'")}
