"""lm-eval's logged requests run again in this process (``benchmarks/third_party_clients.py``,
once its servers are closed): each generation prompt through :func:`~fastprefill.engine.generate`
with the server's method, each log-likelihood pair with full prefill both ways (one forward pass,
and :func:`fastprefill.sampling.prompt_logprobs`). Each returns the per-sample records that
``third_party_clients.json`` keeps and their scores (:mod:`client_scores`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from client_scores import gen_server_side, gen_summary, ll_server_side, ll_summary

__all__ = ["compare_ll", "inprocess_gen", "inprocess_ll", "ll_pair", "lm_eval_request", "messages_of",
           "read_samples"]


def read_samples(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def messages_of(sample: dict[str, Any]) -> list[dict[str, Any]]:
    arg = sample["arguments"]["gen_args_0"]["arg_0"]
    arg = arg[0] if isinstance(arg, list) else arg
    return json.loads(arg) if isinstance(arg, str) else arg


def inprocess_gen(model: Any, tok: Any, spec: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """lm-eval's generation prompts through ``generate`` with the server's method for ``spec``;
    the per-sample records and their :func:`~client_scores.gen_summary`."""
    from fastprefill.engine import generate
    from fastprefill.sampling import SamplingParams
    from fastprefill.serve.config import serving_method

    method = serving_method(spec)
    per = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        msgs = messages_of(s)
        if len(msgs) != 1 or msgs[0]["role"] != "user":
            raise SystemExit(f"lm-eval sent {len(msgs)} messages; one user message expected")
        kw = s["arguments"]["gen_args_0"]["arg_1"]
        params = SamplingParams(stop=tuple(kw.get("until") or ()), max_tokens=int(kw["max_gen_toks"]))
        res = generate(model, tok, msgs[0]["content"], method, chat=True, sampling=params)
        per.append({"doc_id": s["doc_id"], "id": s["doc"]["id"], "answers": list(s["doc"]["answers"]),
                    **gen_server_side(s), "inprocess": res.text, "ttft_s": res.timing.ttft_s})
    return {"method_ran": method.describe(), **gen_summary(per)}


def lm_eval_request(tok: Any, context: str, continuation: str) -> tuple[list[int], int]:
    """The ids lm-eval's ``local-completions`` sends for a log-likelihood pair, and its context
    length: trailing spaces of the context moved to the continuation, then the context's ids
    followed by the whole text's ids past the context's length (lm-eval's ``_encode_pair``)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tok(context, add_special_tokens=False)["input_ids"]
    n_ctx = len(context_ids)
    return context_ids + tok(context + continuation, add_special_tokens=False)["input_ids"][n_ctx:], n_ctx


def inprocess_ll(model: Any, tok: Any, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Each (context, continuation) tokenized as lm-eval's ``_encode_pair`` does and sent as its
    request is (the context's ids, then the ids of the whole text past the context's length: where
    the two merge across the boundary, as ``Answer:`` + ``p`` into ``:p``, that is not the whole
    text's tokenization, and the merged token's tail is dropped), scored twice with full prefill: by one forward pass of the model over both (``whole``), and by
    :func:`fastprefill.sampling.prompt_logprobs` (``chunked``: the server's ``echo`` scoring, a
    forward pass in chunks of 256 tokens over the K/V of the ones before). Each: the
    continuation's log-likelihood and whether every token of it is the greedy one."""
    import torch

    from fastprefill.sampling import prompt_logprobs

    out = {}
    for context, continuation in pairs:
        whole, n_ctx = lm_eval_request(tok, context, continuation)
        ids = torch.tensor([whole], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, n_ctx - 1: len(whole) - 1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        target = ids[0, n_ctx:]
        chunked = prompt_logprobs(model, ids, 1)[n_ctx:]
        out[(context, continuation)] = {
            "loglik_whole": float(logprobs.gather(1, target[:, None]).sum()),
            "greedy_whole": bool((logprobs.argmax(-1) == target).all()),
            "loglik_chunked": sum(e.logprob for e in chunked),
            "greedy_chunked": all(e.logprob >= e.top[0][1] for e in chunked),  # lm-eval's is_greedy
            "tokens": len(whole), "continuation_tokens": len(whole) - n_ctx}
    return out


def ll_pair(sample: dict[str, Any]) -> tuple[str, str]:
    a = sample["arguments"]["gen_args_0"]
    return a["arg_0"], a["arg_1"]


def compare_ll(samples: list[dict[str, Any]], ours: dict[tuple[str, str], dict[str, Any]],
               results: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's log-likelihoods (through the server) against this process's, both ways: the
    per-sample records and their :func:`~client_scores.ll_summary`."""
    per = [{"doc_id": s["doc_id"], "id": s["doc"]["id"], **ll_server_side(s), **ours[ll_pair(s)]}
           for s in sorted(samples, key=lambda s: s["doc_id"])]
    return ll_summary(per, results)
