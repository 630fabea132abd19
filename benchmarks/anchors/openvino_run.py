"""OpenVINO GenAI anchor runner: its own venv (``.venv-anchors/openvino``).

The model is the OpenVINO IR that ``setup.sh openvino`` exported from the prepared folder
(``optimum-cli export openvino --task text-generation-with-past --weight-format fp16``), found at
``<cache>/anchors/openvino/<model>`` (or ``--ir-dir``). ``--model-dir`` names the model, as for
every runner.

Pipeline: ``openvino_genai.LLMPipeline(ir, "CPU", scheduler_config=..., INFERENCE_NUM_THREADS=threads,
INFERENCE_PRECISION_HINT=bf16, CACHE_DIR=...)``. The scheduler config is written out explicitly
with the values GenAI's own LLMPipeline default on CPU has (``get_latency_oriented_scheduler_config``:
paged attention, prefix caching on, no limit on the tokens of one step, so a prompt is one
prefill); passing one makes the continuous-batching (paged-attention) backend certain.

Cold: GenAI has no call that empties the prefix cache, so the pipeline is built anew (compiled
model read back from ``CACHE_DIR``) and run once, untimed, on the warm-up prompt's ids reversed
(same length, no common prefix with any measured prompt), so the cold request pays no first-run
costs and finds nothing of its own prefix. Hit: the follow-up on the same pipeline.

The timed call is ``pipe.generate(ov.Tensor(int64 ids of shape (1, T)), GenerationConfig(max_new_tokens=1,
do_sample=False))``; ``own_ttft_s`` is ``res.perf_metrics.get_ttft().mean`` (ms -> s). Decode steps: a GenerationConfig with
``max_new_tokens=n, ignore_eos=True``; ``own_step_s`` is ``perf_metrics.get_tpot().mean``.

    .venv-anchors/openvino/bin/python benchmarks/anchors/openvino_run.py --model-dir ~/.cache/fastprefill/models/smollm2-135m \
        --prompts prompts-smollm2-135m.jsonl --threads 2 --repeats 3 --out openvino-smollm2-135m.jsonl
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any

from common import System, base_parser, main, model_name_of


def _cache_root() -> Path:
    value = os.environ.get("FASTPREFILL_CACHE_DIR")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "fastprefill"


def _property(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    if not key or not _:
        raise SystemExit(f"--ov-property takes KEY=VALUE, got {text!r}")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


class OpenvinoSystem(System):
    """OpenVINO GenAI LLMPipeline (paged attention, prefix caching)"""

    name = "openvino"

    def load(self, max_prompt_tokens: int) -> None:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        a = self.args
        self.np, self.ov, self.ov_genai = np, ov, ov_genai
        model = model_name_of(a.model_dir)
        self.ir = Path(a.ir_dir).expanduser() if a.ir_dir else _cache_root() / "anchors" / "openvino" / model
        if not (self.ir / "openvino_model.xml").is_file():
            raise SystemExit(f"no OpenVINO IR at {self.ir}: run `bash benchmarks/anchors/setup.sh openvino` "
                             f"(ANCHOR_MODELS={model})")
        self.compile_cache = self.ir / "compiled_cache"
        self.properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": a.threads, "INFERENCE_PRECISION_HINT": a.precision,
                                           "CACHE_DIR": str(self.compile_cache)}
        self.properties.update(dict(_property(p) for p in a.ov_property))
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = True
        sched.max_num_batched_tokens = sys.maxsize if a.max_num_batched_tokens is None else a.max_num_batched_tokens
        sched.cache_size = a.cache_size_gb
        self.sched = sched
        self.gen = ov_genai.GenerationConfig()
        self.gen.max_new_tokens = 1
        self.gen.do_sample = False
        self.pipe = None
        self.reverse_warmup: list[int] | None = None
        self.builds = 0
        self._build()

    def _build(self) -> None:
        self.pipe = None
        gc.collect()
        self.pipe = self.ov_genai.LLMPipeline(str(self.ir), "CPU", scheduler_config=self.sched, **self.properties)
        self.builds += 1

    def versions(self) -> dict[str, str]:
        out = {}
        for dist in ("openvino-genai", "openvino", "openvino-tokenizers", "optimum-intel"):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                out[dist] = "?"
        return out

    def config(self) -> dict[str, Any]:
        s = self.sched
        core = self.ov.Core()
        defaults = {}
        for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION",
                    "DYNAMIC_QUANTIZATION_GROUP_SIZE", "ENABLE_CPU_PINNING"):
            with contextlib.suppress(Exception):  # a property this release does not have
                defaults[key] = str(core.get_property("CPU", key))
        return {"ir": str(self.ir), "ir_weights": "fp16", "properties": self.properties,
                "cpu_plugin_defaults": defaults,
                "scheduler": {"enable_prefix_caching": s.enable_prefix_caching,
                              "max_num_batched_tokens": s.max_num_batched_tokens, "cache_size_gb": s.cache_size,
                              "dynamic_split_fuse": s.dynamic_split_fuse},
                "cold_reset": "new LLMPipeline + untimed run on the reversed warm-up ids"}

    @property
    def dtype(self) -> str:
        return f"fp16 IR, {self.args.precision} inference"

    def reset(self) -> None:
        self._build()
        if self.reverse_warmup is not None:
            self.pipe.generate(self.prepare(self.reverse_warmup), self.gen)

    def prepare(self, ids: list[int]) -> Any:
        if self.reverse_warmup is None:  # the first prompt seen is the warm-up pair's first prompt
            self.reverse_warmup = list(reversed(ids))
        return self.ov.Tensor(self.np.asarray([ids], dtype=self.np.int64))

    def generate_one(self, prepared: Any) -> Any:
        return self.pipe.generate(prepared, self.gen)

    def generate_n(self, prepared: Any, n: int) -> Any:
        gen = self.ov_genai.GenerationConfig()
        gen.max_new_tokens = n
        gen.do_sample = False
        gen.ignore_eos = True
        return self.pipe.generate(prepared, gen)

    def inspect_n(self, raw: Any) -> dict[str, Any]:
        tpot_ms = raw.perf_metrics.get_tpot().mean
        return {"tokens": [int(t) for t in raw.tokens[0]], "own_step_s": tpot_ms / 1000.0 if tpot_ms else None}

    def inspect(self, raw: Any, ids: list[int]) -> dict[str, Any]:
        pm = raw.perf_metrics
        ttft_ms = pm.get_ttft().mean
        return {"first_token": int(raw.tokens[0][0]), "own_ttft_s": ttft_ms / 1000.0 if ttft_ms else None,
                "cached_tokens": None,
                "extra": {"generate_s": pm.get_generate_duration().mean / 1000.0,
                          "inference_s": pm.get_inference_duration().mean / 1000.0,
                          "pipeline_builds": self.builds}}


if __name__ == "__main__":
    parser = base_parser(OpenvinoSystem.__doc__)
    parser.add_argument("--ir-dir", default=None, help="the exported IR (default <cache>/anchors/openvino/<model>)")
    parser.add_argument("--precision", default="bf16", help="INFERENCE_PRECISION_HINT (default bf16)")
    parser.add_argument("--cache-size-gb", type=int, default=0,
                        help="KV cache size in GB for the scheduler (default 0: GenAI grows it as needed)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step (default: no limit, as GenAI's LLMPipeline default)")
    parser.add_argument("--ov-property", action="append", default=[],
                        help="extra CPU property KEY=VALUE, e.g. KV_CACHE_PRECISION=bf16 (repeatable)")
    raise SystemExit(main(OpenvinoSystem, parser))
