"""An OpenAI-compatible HTTP server over one model, with the prefill method chosen per request.

``fastprefill serve --model NAME`` runs :func:`create_app` under uvicorn (:func:`run`, which
drains on SIGTERM); ``app.py`` holds the routes, ``requests.py`` the request processor (a
request becomes one prepared job: every refusal comes from there), ``config.py`` the settings,
``method_table.py`` the methods served, ``worker.py`` the prepared job, its events and the
backend and work contracts, ``backends.py`` what runs a job (the model, or the rank pool; the one
place that asks whether a method runs on ranks), ``scheduler.py`` the one thread that decides
every job's next unit of work and its bounded queue (policy only), ``executor.py`` what runs
those units on the model (the decode batch, the pauses, the answers' text), ``pauses.py`` a
chunk paused between layers, ``ranks.py`` the
rank pool of multi-rank methods (KV-Runahead), ``torchrun.py`` the server over torchrun's ranks
(``fastprefill serve`` under torchrun), ``runner.py`` uvicorn and the draining shutdown,
``protocol.py`` the wire format, ``answers.py`` the answers' chunks, ``limits.py`` the body-size
and prompt-length limits, ``health.py`` ``/health``'s rules, ``metrics.py`` the Prometheus
series. The user's page is ``docs/serving.md``.
"""

from __future__ import annotations

from fastprefill.serve.app import create_app
from fastprefill.serve.backends import start_ranks
from fastprefill.serve.config import PER_REQUEST_METHODS, ServeConfig
from fastprefill.serve.runner import background, run

__all__ = ["PER_REQUEST_METHODS", "ServeConfig", "background", "create_app", "run", "start_ranks"]
