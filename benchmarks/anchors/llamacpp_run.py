"""llama.cpp anchor runner (llama-cpp-python, built from source): its own venv (``.venv-anchors/llamacpp``).

llama.cpp runs the zoo's packaged GGUF (Q4_1 / Q4_K_M quantized weights: not the weights the
other systems run), joined into ``<cache>/anchors/gguf/<model>.gguf`` by ``setup.sh llamacpp``
(or ``--gguf``). ``--model-dir`` names the model, as for every runner. The prepared folder's
tokenizer was converted from that same GGUF, so the prompt ids are the GGUF's own.

Prefix cache: llama-cpp-python keeps the K/V of the tokens it last evaluated and, on the next
``Llama.generate``, reuses the longest common prefix with the new prompt (only the rest is
evaluated). Cold: ``llm.reset()`` plus ``llama_memory_clear`` (nothing kept). Hit: the follow-up
right after the first prompt, whose K/V are still there.

The timed call is ``next(llm.generate(ids, temp=0.0))`` (greedy; one token). ``own_ttft_s`` is
llama.cpp's own prompt-evaluation time (``llama_perf_context``: ``t_p_eval_ms + t_eval_ms``,
reset before the call); ``cached_tokens`` is the prompt length less the tokens it evaluated.

    .venv-anchors/llamacpp/bin/python benchmarks/anchors/llamacpp_run.py --model-dir ~/.cache/fastprefill/models/smollm2-135m \
        --prompts prompts-smollm2-135m.jsonl --threads 2 --repeats 3 --out llamacpp-smollm2-135m.jsonl
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

from common import System, base_parser, main, model_name_of


def _cache_root() -> Path:
    value = os.environ.get("FASTPREFILL_CACHE_DIR")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "fastprefill"


# llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers (general.file_type) of the common GGUF files.
FILE_TYPES = {"0": "F32", "1": "F16", "2": "Q4_0", "3": "Q4_1", "7": "Q8_0", "8": "Q5_0", "9": "Q5_1",
              "10": "Q2_K", "12": "Q3_K_M", "14": "Q4_K_S", "15": "Q4_K_M", "16": "Q5_K_S", "17": "Q5_K_M",
              "18": "Q6_K", "32": "BF16"}


class LlamacppSystem(System):
    """llama.cpp (llama-cpp-python) on the packaged GGUF, with its prompt-prefix K/V reuse"""

    name = "llamacpp"

    def load(self, max_prompt_tokens: int) -> None:
        import llama_cpp

        a = self.args
        self.lc = llama_cpp
        model = model_name_of(a.model_dir)
        self.gguf = Path(a.gguf).expanduser() if a.gguf else _cache_root() / "anchors" / "gguf" / f"{model}.gguf"
        if not self.gguf.is_file():
            raise SystemExit(f"no GGUF at {self.gguf}: run `bash benchmarks/anchors/setup.sh llamacpp` "
                             f"(ANCHOR_MODELS={model})")
        context = int(json.loads((Path(a.model_dir).expanduser() / "config.json").read_text())
                      .get("max_position_embeddings") or 1 << 30)
        self.n_ctx = min(context, -(-(max_prompt_tokens + 16) // 256) * 256)
        self.llm = llama_cpp.Llama(
            model_path=str(self.gguf), n_ctx=self.n_ctx, n_batch=a.n_batch, n_ubatch=a.n_ubatch,
            n_threads=a.threads, n_threads_batch=a.threads, flash_attn=not a.no_flash_attn,
            seed=0, verbose=False,
        )
        ftype = self.llm.metadata.get("general.file_type")
        self.file_type = FILE_TYPES.get(str(ftype), f"file_type {ftype}")

    def versions(self) -> dict[str, str]:
        try:
            version = importlib.metadata.version("llama_cpp_python")
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        return {"llama-cpp-python": version}

    def config(self) -> dict[str, Any]:
        return {"gguf": str(self.gguf), "gguf_file_type": self.file_type, "n_ctx": self.n_ctx,
                "n_batch": self.args.n_batch, "n_ubatch": self.args.n_ubatch,
                "flash_attn": not self.args.no_flash_attn,
                "system_info": self.lc.llama_print_system_info().decode(errors="replace").strip()}

    @property
    def dtype(self) -> str:
        return f"GGUF {self.file_type} weights"

    def reset(self) -> None:
        self.llm.reset()
        mem = self.lc.llama_get_memory(self.llm._ctx.ctx)
        if mem is not None:
            self.lc.llama_memory_clear(mem, True)

    def prepare(self, ids: list[int]) -> Any:
        self.lc.llama_perf_context_reset(self.llm._ctx.ctx)
        return list(ids)

    def generate_one(self, prepared: Any) -> Any:
        gen = self.llm.generate(prepared, temp=0.0)
        token = next(gen)
        gen.close()
        return token

    def inspect(self, raw: Any, ids: list[int]) -> dict[str, Any]:
        perf = self.lc.llama_perf_context(self.llm._ctx.ctx)
        # llama.cpp reports max(1, count) for both counters: a zero time means none was evaluated.
        evaluated = (int(perf.n_p_eval) if perf.t_p_eval_ms > 0 else 0) + (int(perf.n_eval) if perf.t_eval_ms > 0 else 0)
        own = (perf.t_p_eval_ms + perf.t_eval_ms) / 1000.0
        return {"first_token": int(raw), "own_ttft_s": own or None, "cached_tokens": len(ids) - evaluated,
                "extra": {"evaluated_tokens": evaluated, "t_p_eval_s": perf.t_p_eval_ms / 1000.0}}


if __name__ == "__main__":
    parser = base_parser(LlamacppSystem.__doc__)
    parser.add_argument("--gguf", default=None, help="the GGUF file (default <cache>/anchors/gguf/<model>.gguf)")
    parser.add_argument("--n-batch", type=int, default=2048, help="logical batch (default 2048, as llama.cpp's CLI)")
    parser.add_argument("--n-ubatch", type=int, default=512, help="physical batch (default 512, as llama.cpp's CLI)")
    parser.add_argument("--no-flash-attn", action="store_true", help="disable flash attention (on by default)")
    raise SystemExit(main(LlamacppSystem, parser))
