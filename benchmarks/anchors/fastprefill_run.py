"""fastprefill's own anchor runner (fastprefill's venv): full prefill with an exact prefix cache
(``--method``: another method, named with ``--name`` so its rows stand apart from full prefill's).

Cold: a new :class:`fastprefill.PrefixCache` (nothing cached). Hit: the follow-up with the same
cache, which holds the first prompt's K/V. The timed call is
``fastprefill.engine.generate(model, tok, ids, max_new_tokens=1, prefix_cache=cache)`` on a
``(1, T)`` tensor of ids; ``own_ttft_s`` is ``res.timing.ttft_s`` (prefill and the first token,
without the prefix-cache store that follows the token, which the wall time includes). Decode
steps: ``generate(..., max_new_tokens=n, stop_at_eos=False)``, ``own_step_s`` its
``timing.decode_s_per_token``.

    .venv/bin/python benchmarks/anchors/fastprefill_run.py --model-dir ~/.cache/fastprefill/models/smollm2-135m \
        --prompts prompts-smollm2-135m.jsonl --threads 2 --repeats 3 --out fastprefill-smollm2-135m.jsonl
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from common import System, base_parser, main


class FastprefillSystem(System):
    """fastprefill full prefill + PrefixCache"""

    name = "fastprefill"

    def load(self, max_prompt_tokens: int) -> None:
        import torch

        from fastprefill.host import keep_freed_memory, set_threads
        from fastprefill.models import load

        self.kept = keep_freed_memory()
        set_threads(self.args.threads)
        self.torch = torch
        self.model, self.tok = load(self.args.model_dir, dtype=self.args.dtype, progress=False)
        self.method = None
        if self.args.method != "full":
            from fastprefill.methods.registry import make_method

            self.method = make_method(self.args.method)
        self.cache = None

    @property
    def dtype(self) -> str:
        """The dtype the model runs in (``--dtype auto`` resolved), once it is loaded."""
        model = getattr(self, "model", None)
        return str(model.dtype).removeprefix("torch.") if model is not None else str(self.args.dtype)

    def versions(self) -> dict[str, str]:
        out = {}
        for dist in ("fastprefill", "torch", "transformers"):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                out[dist] = "?"
        return out

    def config(self) -> dict[str, Any]:
        return {"method": "full prefill" if self.method is None else self.method.describe(),
                "method_spec": self.args.method, "prefix_cache_mb": self.args.cache_mb, "block_tokens": self.args.block_tokens,
                "keep_freed_memory": self.kept, "torch_threads": self.torch.get_num_threads(),
                "model_dtype": str(self.model.dtype).removeprefix("torch.")}

    def reset(self) -> None:
        from fastprefill import PrefixCache

        self.cache = PrefixCache(self.args.cache_mb << 20, block_tokens=self.args.block_tokens)

    def prepare(self, ids: list[int]) -> Any:
        return self.torch.tensor([ids], dtype=self.torch.long)

    def generate_one(self, prepared: Any) -> Any:
        from fastprefill.engine import generate

        return generate(self.model, self.tok, prepared, self.method, max_new_tokens=1, prefix_cache=self.cache)

    def generate_n(self, prepared: Any, n: int) -> Any:
        from fastprefill.engine import generate

        return generate(self.model, self.tok, prepared, self.method, max_new_tokens=n, prefix_cache=self.cache,
                        stop_at_eos=False)

    def inspect_n(self, raw: Any) -> dict[str, Any]:
        return {"tokens": list(raw.token_ids), "own_step_s": raw.timing.decode_s_per_token}

    def inspect(self, raw: Any, ids: list[int]) -> dict[str, Any]:
        t = raw.timing
        return {"first_token": int(raw.token_ids[0]), "own_ttft_s": t.ttft_s, "cached_tokens": t.cached_tokens,
                "extra": {"prefix_cache": t.prefix_cache, "prefix_lookup_s": t.prefix_lookup_s,
                          "prefix_store_s": t.prefix_store_s, "stored_tokens": t.stored_tokens}}


if __name__ == "__main__":
    parser = base_parser(FastprefillSystem.__doc__)
    parser.add_argument("--dtype", default="auto", help="model dtype (default auto: fastprefill's default)")
    parser.add_argument("--method", default="full",
                        help="a method spec as the CLI takes it (default full; e.g. lazyllm:preset=... with --name)")
    parser.add_argument("--cache-mb", type=int, default=2048, help="PrefixCache bound in MiB (default 2048)")
    parser.add_argument("--block-tokens", type=int, default=16, help="PrefixCache block size (default 16)")
    raise SystemExit(main(FastprefillSystem, parser))
