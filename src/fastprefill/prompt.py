"""A request's prompt turned into validated ids: the one validator of fastprefill.

:func:`prepare_request` is the only place a request is validated (text or ids, bytes that must be
UTF-8, emptiness, the context length, the id range, the method's support for the model and its
own per-prompt limits); :func:`prepare_generation` adds what a generation's sampling and answers
need. :func:`fastprefill.engine.stream`, the ranks of a distributed generation and the server's
request processor (:mod:`fastprefill.serve.requests`) all call them, once per request, so every
entry point refuses the same inputs with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError, PromptError, is_int
from fastprefill.methods.base import Method
from fastprefill.methods.full import FullPrefill
from fastprefill.models.adapters import check_causal_lm
from fastprefill.sampling import SamplingParams

__all__ = ["ChunkedPrompt", "Passage", "PromptInput", "check_answers", "check_text", "context_length", "encode_prompt",
           "prepare_generation", "prepare_request"]


class Passage(str):
    """A part of a :class:`ChunkedPrompt` that is a passage (a chunk whose K/V may be reused)."""

    __slots__ = ()


@dataclass(frozen=True)
class ChunkedPrompt:
    """A prompt made of passages: its ids and each passage's ``[start, end)`` span in them.

    Each part is tokenized on its own, so a passage has the same ids wherever it appears (a
    tokenizer would otherwise merge tokens across its edges) and its K/V can be reused
    (``blend``). Every method accepts one; only a method that reuses passages reads the spans
    (:meth:`~fastprefill.methods.base.Method.with_chunks`), the others prefill the ids.
    """

    ids: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]

    @classmethod
    def from_parts(cls, tokenizer: PreTrainedTokenizerBase, parts: Sequence[str], chat: bool = False) -> ChunkedPrompt:
        """Build one from the prompt's text in parts, the passages marked as :class:`Passage`.

        Args:
            tokenizer: the model's tokenizer.
            parts: the prompt text in order (joined, it is the prompt): plain ``str`` parts
                (instructions, separators, the question) and ``Passage`` parts.
            chat: wrap the joined text in the chat template as one user message; the
                template's text before and after it are parts of their own.

        Raises:
            ConfigError: no passage, or an empty one; a chat template that changes the text.
        """
        passages = [i for i, part in enumerate(parts) if isinstance(part, Passage)]
        if not passages:
            raise ConfigError("a chunked prompt needs at least one passage: mark the passages as Passage(text)")
        if any(not parts[i].strip() for i in passages):
            raise ConfigError(f"passage {next(i for i in passages if not parts[i].strip())} of the parts is empty")
        text = "".join(parts)
        head, tail = "", ""
        templated = chat and bool(getattr(tokenizer, "chat_template", None))
        special: list[int] = [] if templated else tokenizer("")["input_ids"]  # as encode_prompt: BOS, if any
        if templated:
            templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=False)
            if text not in templated:
                raise ConfigError("the chat template changes the prompt's text; build the parts without chat=True")
            head, _, tail = templated.partition(text)
        ids, chunks = list(special), []
        for part in [head, *parts, tail]:
            part_ids = tokenizer(part, add_special_tokens=False)["input_ids"] if part else []
            if isinstance(part, Passage):
                chunks.append((len(ids), len(ids) + len(part_ids)))
            ids += part_ids
        return cls(tuple(ids), tuple(chunks))


#: What a prompt may be: text (or UTF-8 bytes), token ids as a list or a ``(T,)`` / ``(1, T)``
#: tensor, or a :class:`ChunkedPrompt`.
PromptInput = str | bytes | Sequence[int] | torch.Tensor | ChunkedPrompt


def context_length(model: PreTrainedModel) -> int:
    """The model's maximum context (``max_position_embeddings``), or a very large number."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", None) or (1 << 30))


def check_text(prompt: str | bytes) -> str:
    """A text prompt as :func:`encode_prompt` takes it: ``bytes`` decoded as UTF-8, and refused
    when empty or holding NUL characters (no tokenization: a caller that tokenizes the text its own
    way, such as a rendered chat conversation, checks it here first).

    Raises:
        PromptError: naming what is wrong with the text.
    """
    if isinstance(prompt, (bytes, bytearray)):
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(
                f"the prompt is not valid UTF-8 text (byte {exc.start}: {exc.reason}); give text, not binary data"
            ) from None
    if not prompt.strip():
        raise PromptError("the prompt is empty; give some text to answer")
    if "\x00" in prompt:
        raise PromptError("the prompt contains NUL characters; give text, not binary data")
    return prompt


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: PromptInput,
    chat: bool = False,
) -> torch.Tensor:
    """Turn a prompt into ``(1, T)`` int64 ids on the CPU (no model checks: see :func:`prepare_request`).

    Args:
        tokenizer: used for text prompts.
        prompt: text (``bytes`` must be UTF-8), a sequence of ids, or a ``(T,)``/``(1, T)`` tensor of ids.
        chat: wrap text in the tokenizer's chat template as one user message (if it has one).

    Raises:
        PromptError: an empty prompt, bytes that are not UTF-8, text with NUL characters, ids
            that are not integers, or a prompt of another type.
        ConfigError: a text prompt without a tokenizer.
    """
    if isinstance(prompt, (bytes, bytearray, str)):
        prompt = check_text(prompt)
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
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise PromptError(f"prompt ids must be an integer tensor, got dtype {prompt.dtype}")
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise PromptError(f"prompt ids must have shape (T,) or (1, T), got {tuple(prompt.shape)}")
        tensor = prompt.detach().reshape(1, -1).to("cpu", torch.long)
    elif isinstance(prompt, Sequence):
        items = list(prompt)
        if not all(is_int(x) for x in items):
            raise PromptError("prompt ids must be integers; give a list of token ids or a string")
        tensor = torch.tensor([items], dtype=torch.long).reshape(1, -1)
    else:
        raise PromptError(f"the prompt must be text or token ids, got {type(prompt).__name__}")
    if tensor.shape[1] == 0:
        raise PromptError("the prompt is empty (0 tokens); give some text to answer")
    return tensor


def prepare_request(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: PromptInput,
    method: Method | None = None,
    *,
    max_new_tokens: int = 64,
    chat: bool = False,
) -> tuple[torch.Tensor, Method]:
    """Validate a request: its ``(1, T)`` int64 ids on the model's device, and the method that
    runs them (``method.resolve`` for this prompt: ``auto``'s choice, else ``method`` itself).

    The only validator of fastprefill: everything a request can get wrong is refused here,
    before any work or communication starts.

    Args:
        model: a decoder-only causal LM.
        tokenizer: its tokenizer (needed for text).
        prompt: see :data:`PromptInput` (a :class:`ChunkedPrompt` binds its passages to the
            method, :meth:`~fastprefill.methods.base.Method.with_chunks`).
        method: the method that will run (``None``: full prefill); the one it resolves to for
            this prompt (``Method.resolve``) must support the model's family
            (``Method.supports``) and accept the prompt length (``Method.check_prompt``).
        max_new_tokens: tokens to generate, the first included (>= 1).
        chat: wrap text in the chat template.

    Raises:
        PromptError: see :func:`encode_prompt`; prompt + ``max_new_tokens`` over the model's
            context; ids outside the vocabulary.
        ConfigError: ``max_new_tokens`` not an integer >= 1, ``method`` not a Method, or a
            method setting that does not fit this prompt.
        UnsupportedModelError: not a causal LM, or a family the method does not support.
    """
    check_causal_lm(model)
    if not is_int(max_new_tokens, 1):
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    method = method if method is not None else FullPrefill()
    if not isinstance(method, Method):
        raise ConfigError(f"method must be a fastprefill Method or None, got {type(method).__name__}")
    method.check_model(model)
    chunks = prompt.chunks if isinstance(prompt, ChunkedPrompt) else None
    input_ids = encode_prompt(tokenizer, list(prompt.ids) if isinstance(prompt, ChunkedPrompt) else prompt, chat=chat)
    n_prompt = int(input_ids.shape[1])
    chosen = method.resolve(model, n_prompt)
    if chunks is not None:
        chosen = chosen.with_chunks(chunks)
    if chosen is not method:
        chosen.check_model(model)
    limit = context_length(model)
    if n_prompt + max_new_tokens > limit:
        raise PromptError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {limit} tokens; shorten the prompt or lower max_new_tokens"
        )
    vocab = model.get_input_embeddings().num_embeddings
    if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
        raise PromptError(f"prompt ids must lie in [0, {vocab}); got {int(input_ids.min())}..{int(input_ids.max())}")
    chosen.check_prompt(model, n_prompt)
    return input_ids.to(model.device), chosen


def check_answers(model: PreTrainedModel, method: Method, n: int) -> None:
    """Refuse ``n > 1`` answers with a ``method`` (as resolved for the prompt) that decodes with
    its own step (:meth:`~fastprefill.methods.base.Method.own_decoder`: LazyLLM's revival), whose
    state a copy of the cache does not carry.

    Raises:
        ConfigError: naming ``n`` and the way out.
    """
    if n > 1 and method.own_decoder(model):
        raise ConfigError(f"n={n}: several answers from one prefill need a method that decodes with the model's "
                          f"forward; {method.describe()} decodes with its own step (LazyLLM: give revival=none)")


def prepare_generation(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: PromptInput,
    method: Method | None = None,
    max_new_tokens: int = 64,
    *,
    chat: bool = False,
    sampling: SamplingParams | None = None,
) -> tuple[torch.Tensor, Method]:
    """Everything a :class:`~fastprefill.engine.Generation` needs checked, once, before any work:
    the prompt's ``(1, T)`` ids and the method resolved for it (:func:`prepare_request`, with the
    token budget ``sampling`` gives), ``sampling``'s ids against the vocabulary, and ``n`` answers
    against the method (:func:`check_answers`). :func:`fastprefill.engine.stream` and the ranks of
    a distributed generation given a raw prompt call it; a ``Generation`` then trusts its ids.

    Raises:
        PromptError, ConfigError, UnsupportedModelError: as :func:`prepare_request` says;
            ConfigError for a ``logit_bias`` id outside the vocabulary, or ``n > 1`` with a
            method that decodes with its own step.
    """
    params = sampling if sampling is not None else SamplingParams()
    method = method if method is not None else FullPrefill()
    input_ids, method = prepare_request(model, tokenizer, prompt, method, max_new_tokens=params.budget(max_new_tokens),
                                        chat=chat)
    params.check_vocab(model.get_input_embeddings().num_embeddings)
    check_answers(model, method, params.n)
    return input_ids, method
