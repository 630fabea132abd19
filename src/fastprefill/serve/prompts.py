"""Requests' prompts turned into validated ids beside the scheduler's work.

:class:`PromptChecker` first refuses a prompt with more characters than the model's context can
hold (:func:`fastprefill.serve.limits.prompt_char_limit`: no tokenization needed), then runs
:func:`fastprefill.prompt.prepare_request` (ids validated, the method resolved for the prompt) on one of :data:`CHECK_THREADS` threads, each call
with a tokenizer copy of its own (a fast tokenizer is not safe to share between threads), so
neither the scheduler's work nor other requests wait for a long tokenization. A conversation
of several messages is rendered with the model's chat template here, and ``n > 1`` answers are
refused for a method that decodes with its own step (:func:`fastprefill.engine.check_answers`).
"""

from __future__ import annotations

import asyncio
import copy
import queue
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.engine import check_answers
from fastprefill.errors import ConfigError, FastprefillError
from fastprefill.methods.base import Method
from fastprefill.prompt import PromptInput, context_length, prepare_request
from fastprefill.serve.limits import prompt_char_limit
from fastprefill.serve.protocol import APIError, ChatRequest, CompletionRequest, prompt_bytes

__all__ = ["CHECK_THREADS", "PromptChecker"]

#: Threads (each with its own tokenizer copy) that validate and tokenize prompts beside the scheduler.
CHECK_THREADS = 4


class PromptChecker:
    """A server's prompt validation (see the module docstring).

    Attributes:
        context: the model's context in tokens.
        vocab_size: the model's vocabulary size (ids a prompt may hold).
        max_prompt_chars: characters over which a prompt cannot fit the context (``None``: the
            tokenizer gives no safe bound).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = model
        self.context = context_length(model)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_prompt_chars = prompt_char_limit(tokenizer, self.context)
        self._tokenizers: queue.SimpleQueue[PreTrainedTokenizerBase] = queue.SimpleQueue()
        for _ in range(CHECK_THREADS):
            self._tokenizers.put(copy.deepcopy(tokenizer))
        self._threads = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="fastprefill-check")

    def close(self) -> None:
        """Stop the checker threads (checks not started are cancelled)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def check_length(self, text: str, param: str) -> None:
        """Refuse ``text`` (what will be tokenized, or a part of it that the tokenizer keeps)
        if it has more characters than the model's context can hold: no tokenization needed.

        Raises:
            APIError: 400.
        """
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"the prompt has {len(text)} characters, more than the model's context of "
                                f"{self.context} tokens can hold (at most {limit} characters); shorten it",
                           param=param)

    def check_lengths(self, req: ChatRequest | CompletionRequest) -> None:
        """:meth:`check_length` on what can be counted before the chat template runs: a text
        prompt, or the one user message (stripped: a template may trim it)."""
        if isinstance(req, CompletionRequest):
            prompt = req.single_prompt(self.vocab_size)
            if isinstance(prompt, str):
                self.check_length(prompt, "prompt")
        elif len(req.messages) == 1 and req.messages[0].role == "user":
            self.check_length(req.messages[0].text().strip(), "messages")

    def _prepare(self, tok: PreTrainedTokenizerBase, prompt: PromptInput, method: Method, max_tokens: int,
                 chat: bool) -> tuple[torch.Tensor, Method]:
        try:
            return prepare_request(self.model, tok, prompt, method, max_new_tokens=max_tokens, chat=chat)
        except FastprefillError as exc:
            raise APIError(400, str(exc)) from None

    async def prompt_ids(self, req: ChatRequest | CompletionRequest, method: Method,
                         max_tokens: int) -> tuple[torch.Tensor, Method]:
        """The request's ``(1, T)`` prompt ids and the method resolved for them, validated by
        :func:`~fastprefill.prompt.prepare_request` on a checker thread.

        Raises:
            APIError: 400 for a prompt the model cannot take, or for ``n > 1`` answers with the
                method this prompt resolves to when it decodes with its own step
                (:func:`~fastprefill.engine.check_answers`).
        """
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._on_thread, req, method,
                                                                max_tokens)

    def _on_thread(self, req: ChatRequest | CompletionRequest, method: Method,
                   max_tokens: int) -> tuple[torch.Tensor, Method]:
        tok = self._tokenizers.get()
        try:
            ids, resolved = self._prompt_ids(tok, req, method, max_tokens)
        finally:
            self._tokenizers.put(tok)
        try:
            check_answers(self.model, resolved, req.n or 1)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="n") from None
        return ids, resolved

    def _prompt_ids(self, tok: PreTrainedTokenizerBase, req: ChatRequest | CompletionRequest, method: Method,
                    max_tokens: int) -> tuple[torch.Tensor, Method]:
        if isinstance(req, CompletionRequest):
            prompt = req.single_prompt(self.vocab_size)
            return self._prepare(tok, prompt_bytes(prompt) if isinstance(prompt, str) else prompt, method,
                                 max_tokens, chat=False)
        msgs = req.messages
        if len(msgs) == 1 and msgs[0].role == "user":  # exactly `generate(..., chat=True)`
            return self._prepare(tok, prompt_bytes(msgs[0].text()), method, max_tokens, chat=True)
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template, so a conversation must be one user "
                                "message; send raw text to /v1/completions", param="messages")
        from jinja2 import TemplateError

        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in msgs]
        try:
            text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise APIError(400, f"messages: the model's chat template refuses them: {exc}", param="messages") from None
        self.check_length(text, "messages")
        # The rendered conversation is checked as text (UTF-8, NUL characters, limits: with a BOS
        # the tokenizer may add, one token stricter), then as the ids the template itself gives
        # (the template holds the special tokens, so none are added).
        self._prepare(tok, prompt_bytes(text), method, max_tokens, chat=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return self._prepare(tok, ids, method, max_tokens, chat=False)
