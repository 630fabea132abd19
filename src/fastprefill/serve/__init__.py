"""An OpenAI-compatible HTTP server over one model, with the prefill method chosen per request.

``fastprefill serve --model NAME`` runs :func:`create_app` under uvicorn (:func:`run`, which
drains on SIGTERM); ``app.py`` holds the routes, ``config.py`` the settings and the method
table, ``runner.py`` uvicorn and the draining shutdown, ``worker.py`` the prepared request and its
events, ``backends.py`` what runs a request (the model, or the rank pool), ``scheduler.py`` the one
thread that runs every request's work and its bounded queue, ``ranks.py`` the rank pool of multi-rank methods (KV-Runahead),
``torchrun.py`` the server over torchrun's ranks (``fastprefill serve`` under torchrun),
``protocol.py`` the wire format, ``limits.py`` the body-size and prompt-length limits checked
before any model work, ``prompts.py`` the prompts' validation on checker threads beside the
scheduler, ``metrics.py`` the Prometheus series. The user's page is ``docs/serving.md``.
"""

from __future__ import annotations

from fastprefill.serve.app import create_app
from fastprefill.serve.backends import start_ranks
from fastprefill.serve.config import PER_REQUEST_METHODS, ServeConfig
from fastprefill.serve.runner import background, run

__all__ = ["PER_REQUEST_METHODS", "ServeConfig", "background", "create_app", "run", "start_ranks"]
