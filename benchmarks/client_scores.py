"""The scores ``benchmarks/third_party_clients.py`` writes, made from per-sample records only (no
client, no model), so that ``benchmarks/verify.py`` makes them again from a run's saved files.

A row of ``third_party_clients.json`` (one method spec) keeps its per-sample records beside its
scores: ``gen.inprocess.samples`` (per lm-eval generation request: the gold answers, the
server's answer and lm-eval's exact match of it, the in-process answer) and
``ll.inprocess.samples`` (per log-likelihood request: the server's log-likelihood and greedy
flag as lm-eval logged them, and the in-process ones by one forward pass, ``whole``, and by
``prompt_logprobs``, ``chunked``). :func:`rescore_row` re-derives from those, and from the
clients' own files when they are in the method's folder (lm-eval's sample logs, ``langchain.json``,
``guidellm.json``), every value of the row that does not need a client or the model to run.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastprefill.data import metrics

__all__ = ["GEN_METRIC", "folder_of", "gen_server_side", "gen_summary", "guidellm_summary", "langchain_summary",
           "ll_server_side", "ll_summary", "lm_eval_exact_match", "lm_eval_ll_results", "rescore_row",
           "scores_equal"]

#: lm-eval's aggregate key of the generation task's score (metric ``exact_match``, filter ``strip``).
GEN_METRIC = "exact_match,strip"


def folder_of(out: Path, spec: str) -> Path:
    """The folder of one method spec's files under the run's ``--out``."""
    return out / spec.replace(":", "_").replace(",", "_").replace("=", "-")


def lm_eval_exact_match(response: str, answers: Sequence[str]) -> float:
    """lm-eval's score of ``response`` in ``fastprefill_squad_gen``: the ``strip`` filter, then
    ``exact_match`` with case and punctuation ignored, 1 if any gold answer matches."""
    table = str.maketrans("", "", string.punctuation)
    pred = response.strip().lower().translate(table)
    return float(any(pred == a.lower().translate(table) for a in answers))


# --------------------------------------------------------------------------- lm-eval


def gen_server_side(sample: dict[str, Any]) -> dict[str, Any]:
    """The server's side of one lm-eval generation sample (its log line): the answer and
    lm-eval's exact match of it."""
    return {"server": sample["resps"][0][0], "em_server": sample[GEN_METRIC.split(",")[0]]}


def gen_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The in-process comparison of lm-eval's generation task from its per-sample records
    (``answers``, ``server``, ``em_server``, ``inprocess``): how many answers are identical, how
    many of lm-eval's scores :func:`lm_eval_exact_match` scores differently, both sides' mean
    exact match, the project's SQuAD F1 and exact match of both sides, and the records with
    ``identical`` and ``em_inprocess`` filled in."""
    rows = [{**s, "identical": s["server"] == s["inprocess"],
             "em_inprocess": lm_eval_exact_match(s["inprocess"], s["answers"])} for s in samples]
    n = len(rows)
    squad = {f"{name}_{side}": sum(score(r[side], r["answers"]) for r in rows) / n
             for name, score in (("f1", metrics.qa_f1), ("em", metrics.exact_match)) for side in ("server", "inprocess")}
    return {"n": n, "identical": sum(r["identical"] for r in rows),
            # lm_eval_exact_match against lm-eval's own, on the server's answers
            "exact_match_rescored_differently": sum(lm_eval_exact_match(r["server"], r["answers"]) != r["em_server"]
                                                    for r in rows),
            "exact_match_lm_eval": sum(r["em_server"] for r in rows) / n,
            "exact_match_inprocess": sum(r["em_inprocess"] for r in rows) / n,
            "squad_scores": squad,  # the project's singledoc-qa scoring
            "samples": rows}


def ll_server_side(sample: dict[str, Any]) -> dict[str, Any]:
    """The server's side of one lm-eval log-likelihood sample (its log line)."""
    loglik, greedy = sample["resps"][0][0]
    return {"loglik_server": float(loglik), "greedy_server": greedy in (True, "True")}


def lm_eval_ll_results(samples: list[dict[str, Any]]) -> dict[str, float]:
    """lm-eval's aggregates of the log-likelihood task from the server's per-sample values:
    ``perplexity`` (exp of minus the mean log-likelihood) and ``acc`` (the share of greedy
    continuations)."""
    n = len(samples)
    return {"perplexity,none": math.exp(-sum(s["loglik_server"] for s in samples) / n),
            "acc,none": sum(s["greedy_server"] for s in samples) / n}


def ll_summary(samples: list[dict[str, Any]], results: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's log-likelihoods (through the server) against this process's, both ways
    (``whole``: one forward pass; ``chunked``: ``prompt_logprobs``), from the per-sample records;
    ``results`` are lm-eval's aggregates, set beside."""
    n = len(samples)
    row: dict[str, Any] = {"n": n, "perplexity_lm_eval": results.get("perplexity,none"),
                           "acc_lm_eval": results.get("acc,none")}
    for way, suffix in (("whole", ""), ("chunked", "_chunked")):
        diffs = [abs(s["loglik_server"] - s[f"loglik_{way}"]) for s in samples]
        row.update({f"perplexity_inprocess{suffix}": math.exp(-sum(s[f"loglik_{way}"] for s in samples) / n),
                    f"acc_inprocess{suffix}": sum(s[f"greedy_{way}"] for s in samples) / n,
                    f"max_abs_loglik_diff{suffix}": max(diffs), f"mean_abs_loglik_diff{suffix}": sum(diffs) / n,
                    f"same_greedy_flag{suffix}": sum(s["greedy_server"] == s[f"greedy_{way}"] for s in samples)})
    return {**row, "samples": samples}


def scores_equal(task: str, inprocess: dict[str, Any], results: dict[str, Any]) -> bool:
    """Whether lm-eval's score of ``task`` (``gen`` or ``ll``) through the server equals the
    in-process one: the generation task's mean exact match; the log-likelihood task's ``acc``
    and every log-likelihood (``prompt_logprobs``, the server's own scoring, against the server)."""
    if task == "gen":
        return inprocess["exact_match_lm_eval"] == inprocess["exact_match_inprocess"]
    return inprocess["acc_inprocess_chunked"] == results.get("acc,none") and inprocess["max_abs_loglik_diff_chunked"] == 0.0


# --------------------------------------------------------------------------- guidellm, LangChain


def guidellm_summary(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark of a guidellm JSON report."""
    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]

        def ok(name: str, m: dict[str, Any] = m) -> dict[str, Any]:
            return m[name]["successful"]

        ttft = ok("time_to_first_token_ms")
        strategy = bench["config"]["strategy"]
        rows.append({
            "strategy": strategy.get("type_"), "streams": strategy.get("streams"),
            "requests": {k: m["request_totals"][k] for k in ("successful", "errored", "incomplete")},
            "ttft_p50_ms": ttft["percentiles"]["p50"], "ttft_p99_ms": ttft["percentiles"]["p99"],
            "ttft_mean_ms": ttft["mean"],
            "output_tokens_per_s": ok("output_tokens_per_second")["mean"],
            "requests_per_s": ok("requests_per_second")["mean"],
            "itl_p50_ms": ok("inter_token_latency_ms")["percentiles"]["p50"],
            "prompt_tokens_p50": ok("prompt_token_count")["percentiles"]["p50"],
            "output_tokens_p50": ok("output_token_count")["percentiles"]["p50"],
            "duration_s": bench.get("duration"),
        })
    return rows


def later_turns_hit(cached_tokens: list[int | None]) -> bool:
    """Whether every turn after the first found cached tokens."""
    return all((c or 0) > 0 for c in cached_tokens[1:])


def langchain_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The usage of a LangChain conversation's turns (``benchmarks/clients/langchain_chat.py``'s file)."""
    usage = [t["usage"] for t in doc["turns"]]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usage]
    return {"request_fields": doc.get("request_fields"), "cached_tokens": cached,
            "prompt_tokens": [u.get("prompt_tokens") for u in usage],
            "prefix_cache": [(u.get("fastprefill") or {}).get("prefix_cache") for u in usage],
            "server_ttft_s": [(u.get("fastprefill") or {}).get("ttft_s") for u in usage],
            "later_turns_hit": later_turns_hit(cached)}


# --------------------------------------------------------------------------- one row again


def _logged(folder: Path, task: str) -> dict[int, dict[str, Any]]:
    """lm-eval's sample log of ``task`` under ``folder`` by ``doc_id`` (empty when not kept)."""
    logs = sorted(folder.rglob(f"samples_{task}_*.jsonl"))
    lines = logs[-1].read_text().splitlines() if logs else []
    return {s["doc_id"]: s for s in map(json.loads, filter(str.strip, lines))}


def _answers(out: Path) -> dict[str, list[str]]:
    """The gold answers by question id from the run's ``tasks/squad.jsonl`` (runs that saved
    no answers in their samples)."""
    path = out / "tasks" / "squad.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {q["id"]: q["answers"] for q in map(json.loads, filter(str.strip, lines))}


def rescore_row(row: dict[str, Any], out: Path) -> dict[str, Any]:
    """What of one method's ``row`` of ``third_party_clients.json`` in ``out`` re-derives from its
    per-sample records (module docstring), in the row's own shape: the in-process comparisons,
    lm-eval's aggregates and ``scores_equal``; the server's per-sample values taken from
    lm-eval's sample logs, and LangChain's and guidellm's summaries from their files, when those
    are in the method's folder (else only ``later_turns_hit`` from the recorded cached tokens)."""
    folder = folder_of(out, row["method"])
    found: dict[str, Any] = {}
    gen = row.get("gen", {}).get("inprocess")
    if gen is not None:
        logged, answers = _logged(folder / "gen", "fastprefill_squad_gen"), _answers(out)
        again = gen_summary([{"answers": answers.get(s["id"]), **s,
                              **(gen_server_side(logged[s["doc_id"]]) if s["doc_id"] in logged else {})}
                             for s in gen["samples"]])
        found["gen"] = {"inprocess": again, "results": {GEN_METRIC: again["exact_match_lm_eval"]},
                        "scores_equal": scores_equal("gen", again, row["gen"]["results"])}
    ll = row.get("ll", {}).get("inprocess", {})
    if "samples" in ll:
        logged = _logged(folder / "ll", "fastprefill_squad_ll")
        samples = [{**s, **(ll_server_side(logged[s["doc_id"]]) if s["doc_id"] in logged else {})}
                   for s in ll["samples"]]
        again = ll_summary(samples, row["ll"]["results"])
        found["ll"] = {"inprocess": again, "results": lm_eval_ll_results(samples),
                       "scores_equal": scores_equal("ll", again, row["ll"]["results"])}
    if "langchain" in row:
        path = folder / "langchain.json"
        found["langchain"] = (langchain_summary(json.loads(path.read_text())) if path.exists()
                              else {"later_turns_hit": later_turns_hit(row["langchain"]["cached_tokens"])})
    if "guidellm" in row and (folder / "guidellm.json").exists():
        found["guidellm"] = {"rows": guidellm_summary(json.loads((folder / "guidellm.json").read_text()))}
    return found
