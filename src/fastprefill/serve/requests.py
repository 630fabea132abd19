"""The request processor: a wire request becomes one prepared :class:`~fastprefill.serve.worker.Job`.

:meth:`RequestProcessor.process` is the one function between a request's body and the
scheduler's queue (vLLM's ``InputProcessor`` is the model), and every refusal of a request
comes from it: the body's schema, the model's name, the sampling parameters, the method (the
server's, or the request's ``"fastprefill": {"method": SPEC}``,
:class:`~fastprefill.serve.method_table.MethodTable`), the prompt's length in characters against
what the context can hold (:func:`fastprefill.serve.limits.prompt_char_limit`: no tokenization
needed), then, on one of :data:`CHECK_THREADS` threads each with a tokenizer copy of its own (a
fast tokenizer is not safe to share between threads, and a long tokenization must not hold up
the scheduler or other requests), the prompt tokenized once and validated by
:func:`fastprefill.prompt.prepare_request` (the method resolved for the prompt: ``auto``'s
choice), ``n`` answers against that method (:func:`fastprefill.prompt.check_answers`), and only
then the backend that runs it (:meth:`~fastprefill.serve.backends.Backends.for_method`). Nothing
downstream checks the job again. A conversation of several messages is rendered with the model's
chat template, checked as text and tokenized once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.errors import ConfigError, FastprefillError, PromptError
from fastprefill.methods.base import Method
from fastprefill.prompt import PromptInput, check_answers, check_text, context_length, prepare_request
from fastprefill.serve.backends import Backends
from fastprefill.serve.config import ServeConfig
from fastprefill.serve.limits import prompt_char_limit
from fastprefill.serve.method_table import MethodTable
from fastprefill.serve.metrics import ServeMetrics
from fastprefill.serve.protocol import APIError, ChatRequest, CompletionRequest, parse_request, prompt_bytes
from fastprefill.serve.worker import Job, internal_error

__all__ = ["CHECK_THREADS", "Refused", "RequestProcessor"]

log = logging.getLogger(__name__)

#: Threads (each with its own tokenizer copy) that validate and tokenize prompts beside the scheduler.
CHECK_THREADS = 4


class Refused(Exception):
    """A request refused before it became a job: the error to answer, and the metrics label of
    the method it named (``"invalid"`` when it got no further than that)."""

    def __init__(self, error: APIError, label: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.label = label


@dataclass(frozen=True)
class _Prepared:
    """What the checker thread makes of a request's prompt."""

    ids: torch.Tensor  # (1, T)
    method: Method  # resolved for the prompt
    echo: str | None


class RequestProcessor:
    """A server's requests turned into jobs (see the module docstring).

    Attributes:
        context: the model's context in tokens.
        vocab_size: the model's vocabulary size (ids a prompt may hold).
        max_prompt_chars: characters over which a prompt cannot fit the context (``None``: the
            tokenizer gives no safe bound).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ServeConfig,
                 methods: MethodTable, backends: Backends, metrics: ServeMetrics) -> None:
        self.model, self.config, self.methods, self.backends, self.metrics = model, config, methods, backends, metrics
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

    def check_model(self, model_id: str) -> None:
        """Refuse any model id but the served one.

        Raises:
            APIError: 404.
        """
        if model_id != self.config.model_name:
            raise APIError(404, f"model {model_id!r} is not served here; this server serves "
                                f"{self.config.model_name!r}", kind="not_found_error", param="model")

    async def process(self, body: bytes, chat: bool, arrived: float) -> Job:
        """The request in ``body`` (a chat completion when ``chat``), prepared once as a
        :class:`~fastprefill.serve.worker.Job` on the running event loop.

        Raises:
            Refused: every refusal (400, 404 for another model, 503 for a rank pool that has
                failed, 500 for an unexpected failure, which the server log details), with the
                label its metrics count it under.
        """
        label = "invalid"
        try:
            req = parse_request(body, ChatRequest if chat else CompletionRequest)
            self.check_model(req.model)
            max_tokens = req.budget() or self.config.max_tokens
            sampling = req.sampling(self.vocab_size, max_tokens)
            label, method = self.methods.get(req.fastprefill.method)
            prompt = self._prompt(req)
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._threads, self._on_thread, req, prompt, method, max_tokens)
            backend = self.backends.for_method(prepared.method)  # after the method is resolved; 503 once its pool failed
            return Job(prepared.ids, prepared.method, backend, label, prepared.method.served_name(), max_tokens,
                       sampling, req.stream, arrived, arrived + self.config.timeout_s, self.metrics, loop,
                       echo=prepared.echo, stream_options=req.stream_options)
        except APIError as exc:
            raise Refused(exc, label) from None
        except Exception as exc:  # a bug, not the request's fault: answered and counted all the same
            log.exception("request failed before generation")
            raise Refused(internal_error(exc), label) from None

    # --- the prompt ------------------------------------------------------------------------------
    def _check_length(self, text: str, param: str) -> None:
        """Refuse ``text`` (what will be tokenized, or a part of it that the tokenizer keeps) if it
        has more characters than the model's context can hold: no tokenization needed.

        Raises:
            APIError: 400.
        """
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"the prompt has {len(text)} characters, more than the model's context of "
                                f"{self.context} tokens can hold (at most {limit} characters); shorten it",
                           param=param)

    def _prompt(self, req: ChatRequest | CompletionRequest) -> str | list[int] | None:
        """The completion's one prompt (text or ids), or a chat's one user message; ``None`` for a
        conversation of several messages (the chat template renders it on the checker thread).
        Text is refused here when its characters cannot fit the context."""
        if isinstance(req, CompletionRequest):
            prompt = req.single_prompt()
            if isinstance(prompt, str):
                self._check_length(prompt, "prompt")
            return prompt
        if len(req.messages) == 1 and req.messages[0].role == "user":
            text = req.messages[0].text()
            self._check_length(text.strip(), "messages")  # stripped: a template may trim it
            return text
        return None

    def _on_thread(self, req: ChatRequest | CompletionRequest, prompt: str | list[int] | None, method: Method,
                   max_tokens: int) -> _Prepared:
        tok = self._tokenizers.get()
        try:
            prepared = self._prepare(tok, req, prompt, method, max_tokens)
        finally:
            self._tokenizers.put(tok)
        try:
            check_answers(self.model, prepared.method, req.n or 1)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="n") from None
        return prepared

    def _prepare(self, tok: PreTrainedTokenizerBase, req: ChatRequest | CompletionRequest,
                 prompt: str | list[int] | None, method: Method, max_tokens: int) -> _Prepared:
        param, chat, echo = "messages", False, None
        given: PromptInput
        if isinstance(req, CompletionRequest):
            param = "prompt"
            assert prompt is not None
            given = prompt_bytes(prompt) if isinstance(prompt, str) else prompt
            if req.echo:  # the prompt as sent (text), or its ids decoded
                echo = prompt if isinstance(prompt, str) else tok.decode(prompt)
        elif prompt is not None:  # one user message: exactly `generate(..., chat=True)`
            given, chat = prompt_bytes(prompt), True
        else:
            given = self._conversation(tok, req)
        try:
            ids, resolved = prepare_request(self.model, tok, given, method, max_new_tokens=max_tokens, chat=chat)
        except PromptError as exc:
            raise APIError(400, str(exc), param=param) from None
        except FastprefillError as exc:
            raise APIError(400, str(exc)) from None
        return _Prepared(ids, resolved, echo)

    def _conversation(self, tok: PreTrainedTokenizerBase, req: ChatRequest) -> list[int]:
        """A conversation rendered with the model's chat template, checked as text (its length,
        UTF-8, NUL characters), and tokenized once (the template holds the special tokens, so none
        are added)."""
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template, so a conversation must be one user "
                                "message; send raw text to /v1/completions", param="messages")
        from jinja2 import TemplateError

        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise APIError(400, f"messages: the model's chat template refuses them: {exc}", param="messages") from None
        self._check_length(text, "messages")
        try:
            text = check_text(prompt_bytes(text))
        except PromptError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return tok(text, add_special_tokens=False)["input_ids"]
