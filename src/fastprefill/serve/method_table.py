"""The methods a server serves: its default, the specs built at start, and the per-request ones
built by name, each as the server runs it (:func:`~fastprefill.serve.config.serving_method`)
and with the label its metrics count it under
(:meth:`~fastprefill.methods.base.Method.metric_label`)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from fastprefill.distributed.rank import check_ranks
from fastprefill.errors import FastprefillError
from fastprefill.methods.base import Method
from fastprefill.methods.registry import METHODS, make_method, parse_spec
from fastprefill.serve.backends import Backends
from fastprefill.serve.config import PER_REQUEST_METHODS, serving_method
from fastprefill.serve.protocol import APIError

__all__ = ["MethodTable"]

_PARAM = "fastprefill.method"


class MethodTable:
    """The default method, the ones built at start, and per-request ones built by name.

    Args:
        model: the server's model; every method built at start must support it.
        default: the default spec; ``allowed``: more specs built at start.
        backends: the server's backends, which must be able to run every method built at start
            (:meth:`~fastprefill.serve.backends.Backends.check`: a multi-rank method needs a rank
            pool of its size).

    Raises:
        ConfigError: a spec that does not build, or that no backend of the server can run;
        UnsupportedModelError: a method that does not support the model.
    """

    def __init__(self, model: PreTrainedModel, default: str, allowed: Sequence[str], backends: Backends) -> None:
        self.default = default.strip()
        self.backends = backends
        self.built: dict[str, tuple[str, Method]] = {}
        for spec in (self.default, *(s.strip() for s in allowed)):
            method = serving_method(spec)
            backends.check(method, spec)
            method.check_model(model)
            self.built[spec] = (method.metric_label(), method)

    def get(self, spec: str | None) -> tuple[str, Method]:
        """``(metrics label, method)`` for a request's spec (``None``: the default). A multi-rank
        method may be named per request when the server has a rank pool of its size (not with
        ``table``, a file on the server's disk).

        Raises:
            APIError: 400 for an unknown or badly formed spec, or one not allowed per request.
        """
        spec = self.default if spec is None else spec.strip()
        if spec in self.built:
            return self.built[spec]
        try:
            name, options = parse_spec(spec)
            if name in METHODS and METHODS[name].cls.on_ranks:
                method = self._multi_rank(name, spec, options)
            elif name in METHODS and name not in PER_REQUEST_METHODS:
                raise APIError(400, f"{_PARAM}: a request may name {sorted(PER_REQUEST_METHODS)} or a spec the "
                                    f"server was started with ({sorted(self.built)}), not {spec!r}; start the server "
                                    f"with --allow-method {spec!r} to offer it", param=_PARAM)
            else:
                method = serving_method(spec)
            return method.metric_label(), method
        except FastprefillError as exc:
            raise APIError(400, f"{_PARAM}: {exc}", param=_PARAM) from None

    def _multi_rank(self, name: str, spec: str, options: dict[str, str]) -> Method:
        ranks = self.backends.pool_ranks
        if ranks == 1:
            raise APIError(400, f"{_PARAM}: {name} runs over several processes and is not available in this server, "
                                "which was started without a rank pool; start one with `fastprefill serve --method "
                                f"{name}:procs=N` (or --allow-method), or run it with `python -m fastprefill.launch` "
                                "(or torchrun)", param=_PARAM)
        if "table" in options:
            raise APIError(400, f"{_PARAM}: {name}: a request may not name a table (a file on the server); start the "
                                "server with that spec", param=_PARAM)
        method = make_method(spec)
        check_ranks(method, ranks, f"this server's rank pool has {ranks}")
        return method
