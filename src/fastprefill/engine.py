"""Generation engine: prefill through a method, greedy decoding, honest timings, streaming.

TTFT is measured from the start of prefill (the prompt ids already on the device) through the
first token id (the argmax of the prefill logits). Everything the method does for the first
token is inside that window. On CUDA the device is synchronised before each clock read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError, PromptError
from fastprefill.methods.base import Method
from fastprefill.methods.full import FullPrefill
from fastprefill.models.adapters import check_causal_lm

__all__ = ["GenerationResult", "StreamEvent", "Timing", "encode_prompt", "generate", "stream"]


@dataclass
class Timing:
    """Timings and compute counts of one generation.

    Attributes:
        method: the method's :meth:`~fastprefill.methods.base.Method.describe` string.
        prompt_tokens: prompt length ``T``.
        new_tokens: tokens generated (the first one included).
        ttft_s: seconds from the start of prefill through the first token.
        decode_s_per_token: mean seconds per token after the first (``None`` if only one).
        total_s: TTFT plus all decoding.
        token_layers: prompt (token, layer) pairs the prefill computed.
        total_token_layers: ``T * num_layers``.
        prefill_flops: estimated FLOPs to the first token.
        extra: method counters (prefill and decode).
    """

    method: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_s_per_token: float | None
    total_s: float
    token_layers: int
    total_token_layers: int
    prefill_flops: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def token_layer_fraction(self) -> float:
        return self.token_layers / self.total_token_layers if self.total_token_layers else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_layer_fraction"] = self.token_layer_fraction
        return d


@dataclass
class StreamEvent:
    """One generated token. ``timing`` is set on the last event only."""

    token_id: int
    text: str
    index: int
    timing: Timing | None = None


@dataclass
class GenerationResult:
    """The generated text, its token ids and the :class:`Timing`."""

    text: str
    token_ids: list[int]
    timing: Timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for src in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, Sequence):
            ids.update(int(x) for x in src)
    return ids


def context_length(model: PreTrainedModel) -> int:
    """The model's maximum context (``max_position_embeddings``), or a very large number."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", None) or (1 << 30))


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: str | Sequence[int] | torch.Tensor,
    chat: bool = False,
) -> torch.Tensor:
    """Turn a prompt into ``(1, T)`` int64 ids.

    Args:
        tokenizer: used for text prompts.
        prompt: text, a list of ids, or a ``(T,)``/``(1, T)`` tensor of ids.
        chat: wrap text in the tokenizer's chat template as one user message (if it has one).

    Raises:
        PromptError: if the prompt is empty.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("the prompt is empty; give some text to answer")
        if tokenizer is None:
            raise ConfigError("a tokenizer is needed for a text prompt")
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        tensor = torch.tensor([ids], dtype=torch.long)
    elif isinstance(prompt, torch.Tensor):
        tensor = prompt.reshape(1, -1).to(torch.long)
    else:
        tensor = torch.tensor([list(prompt)], dtype=torch.long)
    if tensor.shape[1] == 0:
        raise PromptError("the prompt is empty (0 tokens); give some text to answer")
    return tensor


def stream(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: str | Sequence[int] | torch.Tensor,
    method: Method | None = None,
    max_new_tokens: int = 64,
    *,
    chat: bool = False,
    stop_at_eos: bool = True,
    stop: Callable[[str], bool] | None = None,
) -> Iterator[StreamEvent]:
    """Greedy generation as an iterator of :class:`StreamEvent` (one per token).

    The last event carries the :class:`Timing`. See :func:`generate` for the arguments.
    """
    check_causal_lm(model)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    method = method if method is not None else FullPrefill()
    if not isinstance(method, Method):
        raise ConfigError(f"method must be a fastprefill Method or None, got {type(method).__name__}")
    input_ids = encode_prompt(tokenizer, prompt, chat=chat)
    n_prompt = int(input_ids.shape[1])
    limit = context_length(model)
    if n_prompt + max_new_tokens > limit:
        raise PromptError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {limit} tokens; shorten the prompt or lower max_new_tokens"
        )
    vocab = model.get_input_embeddings().num_embeddings
    if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
        raise PromptError(f"prompt ids must lie in [0, {vocab}); got {int(input_ids.min())}..{int(input_ids.max())}")
    device = model.device
    input_ids = input_ids.to(device)
    eos = _eos_ids(model, tokenizer) if stop_at_eos else set()

    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        out = method.prefill(model, input_ids)
        token = int(torch.argmax(out.logits))
        _sync(device)
        ttft = time.perf_counter() - t0

        generated = [token]
        decode_time = 0.0
        prev_text = ""
        while True:
            text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
            delta, prev_text = text[len(prev_text):], text
            done = token in eos or len(generated) >= max_new_tokens or (stop is not None and stop(text))
            if done:
                break
            yield StreamEvent(token, delta, len(generated) - 1)
            _sync(device)
            t1 = time.perf_counter()
            logits = method.decode(out.state, token)
            token = int(torch.argmax(logits))
            _sync(device)
            decode_time += time.perf_counter() - t1
            generated.append(token)

        extra = dict(out.stats.extra)
        extra.update(method.decode_stats(out.state))
        steps = len(generated) - 1
        timing = Timing(
            method=method.describe(),
            prompt_tokens=n_prompt,
            new_tokens=len(generated),
            ttft_s=ttft,
            decode_s_per_token=decode_time / steps if steps else None,
            total_s=ttft + decode_time,
            token_layers=out.stats.token_layers,
            total_token_layers=out.stats.total_token_layers,
            prefill_flops=out.stats.flops,
            extra=extra,
        )
        yield StreamEvent(token, delta, len(generated) - 1, timing)


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: str | Sequence[int] | torch.Tensor,
    method: Method | None = None,
    max_new_tokens: int = 64,
    *,
    chat: bool = False,
    stop_at_eos: bool = True,
    stop: Callable[[str], bool] | None = None,
) -> GenerationResult:
    """Generate greedily from ``prompt`` with ``method`` (full prefill when ``None``).

    Args:
        model: a decoder-only causal LM (``AutoModelForCausalLM``), in eval mode.
        tokenizer: its tokenizer (needed for text prompts and for the output text).
        prompt: text, or token ids as a list or a ``(T,)`` / ``(1, T)`` tensor.
        method: a :class:`~fastprefill.methods.base.Method`; ``None`` is full prefill.
        max_new_tokens: at most this many tokens, the first one included (>= 1).
        chat: wrap a text prompt in the tokenizer's chat template.
        stop_at_eos: stop after the model's end-of-sequence token (which is kept in the ids
            and dropped from the text).
        stop: called with the text generated so far after every token; generation ends (that
            token kept) once it returns True. Tasks use it to stop when the rest of the
            answer cannot change the score (e.g. HumanEval after the closing code fence).

    Returns:
        The text, the generated ids and the :class:`Timing`.

    Raises:
        PromptError: empty prompt, or prompt + ``max_new_tokens`` over the model's context.
        ConfigError: ``max_new_tokens < 1`` or a ``method`` that is not a Method.
        UnsupportedModelError: the model is not a causal LM (or not supported by the method).
    """
    ids: list[int] = []
    timing: Timing | None = None
    for event in stream(
        model, tokenizer, prompt, method, max_new_tokens, chat=chat, stop_at_eos=stop_at_eos, stop=stop
    ):
        ids.append(event.token_id)
        timing = event.timing
    assert timing is not None
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
    return GenerationResult(text=text, token_ids=ids, timing=timing)
