"""``fastprefill serve`` under torchrun: the real command on 2 ranks (127.0.0.1, one thread each,
smollm2-135m), through the real ``openai`` client.

``python -m torch.distributed.run --standalone --nproc-per-node 2 -m fastprefill.cli serve ...``:
rank 0 serves HTTP and is the chain's first rank, rank 1 decodes. Answers are compared with
:func:`fastprefill.engine.generate` with full prefill in this process (greedy: the same text).
The tests share one server and run in file order: the last one kills rank 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.runtime import free_port
from fastprefill.serve import ServeConfig
from fastprefill.serve.app import EXIT_GRACE_S
from fastprefill.serve.torchrun import WATCH_PERIOD_S, check_specs
from tests.integration.serving import (
    MODEL,
    http_request,
    is_idle,
    leave_mid_stream,
    metric_value,
    openai_client,
    user_messages,
    wait_health,
)

pytestmark = pytest.mark.integration

RUNAHEAD = "runahead:procs=2"
PROMPT = "The capital of France is"
N = 6
DRAIN_S = 3.0
#: a rank lost: every process gone within the drain, the shutdown's grace periods and one idle check
EXIT_BOUND_S = DRAIN_S + EXIT_GRACE_S + WATCH_PERIOD_S


def _torchrun(log: Path, *serve_args: str, nodes: tuple[str, ...] = ("--standalone", "--nproc-per-node", "2")
              ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes,
           "-m", "fastprefill.cli", "serve", "--model", MODEL, "--threads-per-rank", "1", *serve_args]
    with log.open("w") as out:  # the child keeps its own copy of the file
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _up(url: str, procs: list[subprocess.Popen], log: Path) -> None:
    """Wait until ``/health`` answers 200 (every torchrun process still running)."""
    deadline = time.monotonic() + 240
    while True:
        assert all(p.poll() is None for p in procs), f"the server exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()}"
        try:
            if http_request(url, "GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_the_specs_a_torchrun_server_refuses():
    assert set(check_specs(ServeConfig(MODEL, method=RUNAHEAD, allow_methods=("tsp:procs=2", "full")), 2)) == {
        RUNAHEAD, "tsp:procs=2", "full"}
    for config, world, words in ((ServeConfig(MODEL, method="full"), 2, "multi-rank method over its 2 ranks"),
                                 (ServeConfig(MODEL, method="runahead:procs=1"), 1, "needs at least 2"),
                                 (ServeConfig(MODEL, method=RUNAHEAD, allow_methods=("tsp:procs=4",)), 2,
                                  "needs procs=4 ranks, but torchrun started 2"),
                                 (ServeConfig(MODEL, method="runahead:procs=2,bogus=1"), 2, "bogus")):
        with pytest.raises(ConfigError, match=words):
            check_specs(config, world)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """The torchrun server's URL, its torchrun process and its log (once /health answers)."""
    port = free_port()
    log = tmp_path_factory.mktemp("torchrun") / "serve.log"
    proc = _torchrun(log, "--method", RUNAHEAD, "--port", str(port), "--drain-timeout", str(DRAIN_S),
                     "--prefix-cache-mb", "0")
    url = f"http://127.0.0.1:{port}"
    try:
        _up(url, [proc], log)
        yield url, proc, log
    finally:
        _stop(proc)


@pytest.mark.timeout(300)
def test_runahead_over_torchrun_ranks_answers_as_full_prefill(server, smollm2):
    url, _, _ = server
    model, tok = smollm2
    client = openai_client(url)
    _, health = http_request(url, "GET", "/health")
    assert health["ranks"]["procs"] == 2 and health["ranks"]["up"] and health["method"].startswith("runahead")
    want = generate(model, tok, PROMPT, None, N, chat=True).text
    chat = client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=N)
    assert chat.choices[0].message.content == want
    assert chat.usage.fastprefill["method"].startswith("runahead(procs=2")
    streamed = client.chat.completions.create(model=MODEL, messages=user_messages(PROMPT), max_tokens=N, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "fastprefill"
    # a single-process method per request runs on rank 0 itself
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N,
                                     extra_body={"fastprefill": {"method": "full"}})
    assert full.choices[0].text == generate(model, tok, PROMPT, None, N).text
    assert full.usage.fastprefill["method"] == "full"
    with pytest.raises(openai.BadRequestError, match="rank pool has 2"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                  extra_body={"fastprefill": {"method": "runahead:procs=3"}})
    assert metric_value(url, "fastprefill_ttft_seconds_count", method="runahead") == 2
    assert metric_value(url, "fastprefill_ttft_seconds_count", method="full") == 1
    # a client that leaves mid-stream stops the decode on rank 1 (400 tokens would take far longer)
    leave_mid_stream(client, PROMPT)
    t0 = time.monotonic()
    wait_health(url, is_idle, timeout=60)
    assert time.monotonic() - t0 < 10
    assert metric_value(url, "fastprefill_requests_total", method="runahead", outcome="cancelled") == 1


@pytest.mark.timeout(120)
def test_a_spec_the_ranks_cannot_serve_fails_at_start_on_every_rank_with_one_message(tmp_path):
    log = tmp_path / "bad.log"
    proc = _torchrun(log, "--method", "runahead:procs=3", "--port", str(free_port()))
    try:
        assert proc.wait(90) != 0
    finally:
        _stop(proc)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert "needs procs=3 ranks, but torchrun started 2 ranks" in errors[0]
    assert "Loading weights" not in text  # refused before any model work
    assert "exitcode  : 2" in text


@pytest.mark.timeout(120)
def test_a_killed_rank_gets_503s_and_every_process_exits_in_time(server):
    url, proc, log = server
    _, health = http_request(url, "GET", "/health")
    pids = health["ranks"]["pids"]
    client = openai_client(url).with_options(timeout=60)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"fastprefill": {"ignore_eos": True}})
    chunks = iter(stream)
    next(c for c in chunks if c.choices and c.choices[0].text)  # rank 1 is decoding now
    queued: list[BaseException] = []

    def wait_in_queue() -> None:
        try:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        except openai.APIError as exc:
            queued.append(exc)

    behind = threading.Thread(target=wait_in_queue)
    behind.start()
    wait_health(url, lambda h: h["queue"]["waiting"] == 1, timeout=30)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="rank 1 closed its connection") as running:
        for _ in chunks:
            pass
    assert running.value.body["code"] == 503 and "shutting down" in running.value.body["message"]
    behind.join(60)
    assert not behind.is_alive() and len(queued) == 1
    assert isinstance(queued[0], openai.InternalServerError) and queued[0].status_code == 503
    proc.wait(EXIT_BOUND_S + 5)  # torchrun itself ends once its ranks have
    assert time.monotonic() - t0 < EXIT_BOUND_S + 5, log.read_text()
    assert proc.returncode != 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(180)
def test_two_nodes_on_this_machine_serve_and_a_rank_lost_while_idle_ends_the_server(tmp_path, smollm2):
    """Two torchrun agents, one rank each (``--nnodes 2``, 127.0.0.1 as the master address): the
    ranks are not all local, so rank 0 listens on every interface and rank 1 connects to
    ``MASTER_ADDR``. Killing rank 1 while idle does not make rank 0's agent stop it: rank 0's own
    idle check ends the server, with status 1."""
    model, tok = smollm2
    port, master = free_port(), free_port()
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    procs = [_torchrun(logs[r], "--method", RUNAHEAD, "--port", str(port), "--drain-timeout", str(DRAIN_S),
                       "--prefix-cache-mb", "0",
                       nodes=("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r), "--master-addr",
                              "127.0.0.1", "--master-port", str(master)))
             for r in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    try:
        _up(url, procs, logs[0])
        r = openai_client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=N)
        assert r.choices[0].text == generate(model, tok, PROMPT, None, N).text
        pids = http_request(url, "GET", "/health")[1]["ranks"]["pids"]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        procs[0].wait(EXIT_BOUND_S + 5)
        assert time.monotonic() - t0 < EXIT_BOUND_S + 5
        text = logs[0].read_text()
        assert "idle: rank 1 closed its connection" in text and "exitcode  : 1" in text, text
        procs[1].wait(30)
        with pytest.raises(ProcessLookupError):
            os.kill(pids[0], 0)
    finally:
        for p in procs:
            _stop(p)
