"""Write the anchor prompt set of one model: pre-tokenized (first, follow-up) pairs that share a
document as their prefix, so every system gets exactly the same token ids.

Runs in fastprefill's own venv. Per target length (``--lengths``, default 2048 4096):
``--pairs`` measured pairs plus one warm-up pair (another document), each from one
:func:`fastprefill.data.tasks.sessions.document_sessions` session (a SQuAD v2 article cut to a
token budget, two questions): the first prompt is the document + question 0, the follow-up the
document + question 1 (:func:`~fastprefill.data.tasks.sessions.question_prompt`), each rendered
as one user message with the model's chat template (generation prompt added) and tokenized with
the model's own tokenizer (``add_special_tokens=False``: the template already holds them).

The document budget is ``length - --margin`` tokens (whole paragraphs, as many as fit), so a
prompt is at most about ``length`` tokens; ``prompt_tokens`` in the runs says exactly.

    .venv/bin/python benchmarks/anchors/prompts.py --model smollm2-135m --out prompts-smollm2-135m.jsonl
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path


def _render(tokenizer, text: str) -> tuple[str, list[int]]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return rendered, list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="zoo name (prepared if needed) or a model folder")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="target prompt lengths in tokens")
    p.add_argument("--pairs", type=int, default=3, help="measured pairs per length (default 3)")
    p.add_argument("--margin", type=int, default=64,
                   help="tokens kept free for the instruction, question and chat template (default 64)")
    p.add_argument("--split", default="test", choices=["dev", "test"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from transformers import AutoTokenizer

    import fastprefill
    from fastprefill.data.tasks.sessions import document_sessions, question_prompt
    from fastprefill.models import zoo

    if args.model in zoo.ZOO:
        model_dir, name = zoo.prepare(args.model), args.model
    else:
        model_dir = Path(args.model).expanduser().resolve()
        try:
            name = json.loads((model_dir / "fastprefill.json").read_text())["name"]
        except (OSError, ValueError, KeyError):
            name = model_dir.name
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    context = int(config.get("max_position_embeddings") or 1 << 30)
    vocab = int(config["vocab_size"])

    lines: list[dict] = []
    for length in args.lengths:
        if length - args.margin < 64:
            raise SystemExit(f"length {length} leaves {length - args.margin} tokens for the document (< 64)")
        sessions = document_sessions(tokenizer, length - args.margin, args.pairs + 1, 2, split=args.split,
                                     seed=args.seed)
        # The last session is the warm-up: a document no measured pair uses.
        for i, session in enumerate(sessions):
            role = "warmup" if i == args.pairs else "measure"
            item: dict = {"type": "prompt", "id": f"{length}/{'w' if role == 'warmup' else i}", "role": role,
                          "length": length, "session": session.id}
            for key, q in (("first", 0), ("followup", 1)):
                text, ids = _render(tokenizer, question_prompt(session, q))
                if len(ids) + 1 > context:
                    raise SystemExit(f"{name}: a {len(ids)}-token prompt does not fit the context of {context}")
                if max(ids) >= vocab:
                    raise SystemExit(f"{name}: token id {max(ids)} is outside the vocabulary of {vocab}")
                item[key] = {"question": session.questions[q][0], "answers": list(session.questions[q][1]),
                             "text": text, "ids": ids}
            item["shared_prefix_tokens"] = _common_prefix(item["first"]["ids"], item["followup"]["ids"])
            lines.append(item)
            print(f"{item['id']:<10} {session.id:<40} first {len(item['first']['ids']):>5} tok, follow-up "
                  f"{len(item['followup']['ids']):>5} tok, shared prefix {item['shared_prefix_tokens']}",
                  file=sys.stderr)

    header = {
        "type": "header", "model": name, "model_dir": str(model_dir), "lengths": args.lengths,
        "pairs": args.pairs, "margin": args.margin, "split": args.split, "seed": args.seed,
        "source": "fastprefill.data.tasks.sessions.document_sessions + question_prompt (SQuAD v2)",
        "chat_template": True, "add_special_tokens": False, "fastprefill_version": fastprefill.__version__,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for item in [header, *lines]:
            f.write(json.dumps(item) + "\n")
    print(f"wrote {out}: {len(lines)} pairs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
