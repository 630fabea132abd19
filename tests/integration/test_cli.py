"""The command line as scripts use it: piped tables, ``--json``, binary input, ``serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from fastprefill.cli import main
from fastprefill.engine import generate
from fastprefill.errors import ConfigError
from fastprefill.models import zoo
from fastprefill.runtime import free_port
from fastprefill.sampling import SamplingParams
from tests import REPO

SRC = str(REPO / "src")


def _cli(*args: str, stdin: bytes | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-m", "fastprefill.cli", *args], input=stdin, capture_output=True,
                          env=env, timeout=timeout, check=False)


def test_models_piped_keeps_every_name_whole():
    out = _cli("models")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.decode().splitlines()
    for entry in zoo.list_models():
        assert any(entry.name in line for line in lines), (entry.name, out.stdout.decode())
    assert any("qwen2.5-coder-0.5b" in line and "qwen2" in line for line in lines)  # `| grep` finds the row


def test_models_table_in_process_is_not_cut(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    longest = max(zoo.list_models(), key=lambda e: len(e.licence))
    assert longest.licence in out and all(e.name in out for e in zoo.list_models())


def test_models_json(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == [e.name for e in zoo.list_models()]
    first = rows[0]
    assert set(first) == {"name", "default", "family", "packages", "licence", "prepared"}
    assert sum(r["default"] for r in rows) == 1 and rows[[r["default"] for r in rows].index(True)]["name"] == \
        zoo.DEFAULT_MODEL
    assert all(isinstance(r["prepared"], bool) and r["packages"] for r in rows)


@pytest.mark.integration
def test_generate_json_equals_the_engine(capsys, smollm2_auto):
    model, tok = smollm2_auto  # the command loads the default dtype too
    assert main(["generate", "--json", "--max-new-tokens", "4", "--threads", "2", "What is 2+2?"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = generate(model, tok, "What is 2+2?", None, 4, chat=True)
    assert got["text"] == want.text and got["token_ids"] == want.token_ids
    assert got["method"] == "full" and got["model"] == "smollm2-135m"
    assert got["timing"]["prompt_tokens"] == want.timing.prompt_tokens and got["timing"]["ttft_s"] > 0
    assert got["timing"]["dtype"] == str(model.dtype).removeprefix("torch.")


@pytest.mark.integration
def test_generate_samples_with_a_seed_and_refuses_bad_settings(capsys, smollm2_auto):
    model, tok = smollm2_auto
    args = ["generate", "--json", "--max-new-tokens", "6", "--threads", "2", "--no-warmup", "--temperature", "0.8",
            "--top-k", "30", "--seed", "4", "--logprobs", "1", "Name a colour."]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    want = generate(model, tok, "Name a colour.", None, 6, chat=True,
                    sampling=SamplingParams(temperature=0.8, top_k=30, seed=4, logprobs=1))
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
    assert [e["token_id"] for e in got["logprobs"]] == want.token_ids and len(got["logprobs"][0]["top"]) == 1
    assert main(["generate", "--max-new-tokens", "2", "--top-p", "2", "x"]) == 2
    err = capsys.readouterr().err
    assert "top_p must be a number in (0, 1]" in err and "Traceback" not in err


@pytest.mark.integration
def test_generate_refuses_a_binary_file_with_a_clear_error(capsys, tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"ok \xc3\x28 not utf-8")
    assert main(["generate", "--file", str(blob), "--max-new-tokens", "2", "--threads", "2"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "not valid UTF-8" in err and "Traceback" not in err


@pytest.mark.integration
def test_generate_binary_stdin_exits_2_with_the_prompt_error():
    out = _cli("generate", "--max-new-tokens", "2", "--threads", "1", stdin=b"\xff\xd8\xff\xe0 jpeg")
    err = out.stderr.decode()
    assert out.returncode == 2 and "not valid UTF-8" in err and "Traceback" not in err


@pytest.mark.integration
def test_serve_refuses_a_bad_method(capsys):
    assert main(["serve", "--method", "nosuch", "--port", "1"]) == 2
    assert "unknown method" in capsys.readouterr().err


@pytest.mark.integration
def test_serve_mlock_refused_says_why_and_exits_2(capsys, monkeypatch):
    """``--mlock`` where the kernel refuses the lock: the lock's error, exit 2, no server; under
    torchrun it is refused before anything loads."""
    from fastprefill import host

    def refuse(tensors):
        assert sum(t.numel() for t in tensors) > 0  # the model's weights were handed over
        raise ConfigError("could not lock 0.50 GiB of weights in memory: Operation not permitted (ulimit -l)")

    monkeypatch.setattr(host, "lock_in_memory", refuse)
    assert main(["serve", "--mlock", "--threads", "1", "--port", "1", "--no-compile"]) == 2
    err = capsys.readouterr().err
    assert "could not lock 0.50 GiB" in err and "Traceback" not in err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["serve", "--mlock", "--port", "1"]) == 2
    assert "drop --mlock" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_serve_command_answers_over_http(smollm2_auto):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "fastprefill.cli", "serve", "--port", str(port), "--threads", "1",
                             "--queue", "2", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        deadline = time.monotonic() + 500
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        assert [m.id for m in models] == ["smollm2-135m"]
        r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}],
                                           max_tokens=3)
        model, tok = smollm2_auto  # the command loads the default dtype too
        assert r.choices[0].message.content == generate(model, tok, "Hi!", None, 3, chat=True).text
        assert r.usage.model_extra["fastprefill"]["dtype"] == str(model.dtype).removeprefix("torch.")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read().decode()


# --- what a new user meets first ----------------------------------------------------------------
def _help(capsys, monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "2000")  # one help line per option: names are never wrapped
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text_and_lists_every_method_and_task(capsys, monkeypatch):
    from fastprefill.data.tasks import TASKS
    from fastprefill.methods.registry import METHODS

    texts = {cmd: _help(capsys, monkeypatch, *cmd.split()) for cmd in ("", "generate", "bench", "demo", "models")}
    for cmd, text in texts.items():
        assert "``" not in text and ":func:" not in text, cmd
    method_help = next(ln for ln in texts["generate"].splitlines() if ln.strip().startswith("--method"))
    assert all(name in method_help for name in METHODS), method_help
    task_help = next(ln for ln in texts["bench"].splitlines() if ln.strip().startswith("--task"))
    assert all(name in task_help for name in TASKS), task_help
    assert "gemfilter" in method_help and "humaneval-completion" in task_help


def test_version(capsys):
    from fastprefill import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"fastprefill {__version__}"


def test_a_model_that_cannot_be_fetched_is_one_line_and_status_2():
    env = {"HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "fastprefill.cli", "generate", "hi", "--model", "no-such-org/no-such-model"],
                         capture_output=True, timeout=300, check=False,
                         env={**os.environ, **env, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")})
    lines = [ln for ln in out.stderr.decode().splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr.decode()
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert all(hint in lines[0] for hint in ("no-such-org/no-such-model", "HF_HUB_OFFLINE=1", "local model folder",
                                             zoo.DEFAULT_MODEL))


@pytest.mark.integration
@pytest.mark.parametrize("warm", [True, False])
def test_generate_times_after_an_untimed_warm_up(capsys, monkeypatch, smollm2, warm):
    from fastprefill import engine

    calls: list[tuple[str, int]] = []
    real_generate, real_stream = engine.generate, engine.stream

    def spy_generate(model, tok, prompt, method=None, max_new_tokens=64, **kw):
        calls.append(("generate", max_new_tokens))
        return real_generate(model, tok, prompt, method, max_new_tokens, **kw)

    def spy_stream(model, tok, prompt, method=None, max_new_tokens=64, **kw):
        calls.append(("stream", max_new_tokens))
        return real_stream(model, tok, prompt, method, max_new_tokens, **kw)

    monkeypatch.setattr(engine, "generate", spy_generate)
    monkeypatch.setattr(engine, "stream", spy_stream)
    argv = ["generate", "What is 2+2?", "--max-new-tokens", "3", "--threads", "1", "--method", "lazyllm"]
    assert main(argv + ([] if warm else ["--no-warmup"])) == 0
    err = capsys.readouterr().err
    if warm:  # the warm-up runs the same method (a prefill and a decode step, untimed) before the timed stream
        assert calls[0] == ("generate", 2) and calls[-1] == ("stream", 3)
        assert [c for c in calls if c[0] == "generate"] == [("generate", 2)]
        assert "excludes an untimed warm-up run of" in err
    else:
        assert calls == [("stream", 3)] and "includes one-time start-up costs" in err


@pytest.mark.integration
def test_generate_json_reports_the_warm_up_apart(capsys):
    assert main(["generate", "--json", "--max-new-tokens", "2", "--threads", "1", "Hi"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["warmup_s"] > 0 and got["timing"]["ttft_s"] > 0
    assert main(["generate", "--json", "--no-warmup", "--max-new-tokens", "2", "--threads", "1", "Hi"]) == 0
    assert json.loads(capsys.readouterr().out)["warmup_s"] is None


def test_spread_is_the_median_and_the_range():
    from fastprefill.demo import spread

    assert spread([3.0, 1.0, 2.0]) == "2.000 [1.000, 3.000]"
    assert spread([1.5, 2.5], 2, "x") == "2.00x [1.50, 2.50]"


@pytest.mark.integration
def test_demo_repeats_each_method_after_a_warm_up_and_shows_median_and_range(capsys, monkeypatch, smollm2):
    """Timings are scripted (a fake engine call) so the table's medians and ranges can be checked."""
    from types import SimpleNamespace

    from fastprefill import engine
    from fastprefill.demo import demo_methods

    calls: list[tuple[str, int]] = []
    ttft = {"FullPrefill": [9.0, 4.0, 6.0, 5.0]}  # per method class: warm-up first, then the timed runs

    def fake_generate(model, tok, ids, method=None, max_new_tokens=64, **kw):
        name = type(method).__name__
        calls.append((name, max_new_tokens))
        series = ttft.get(name, [9.0, 2.0, 3.0, 2.5])
        t = series[(sum(c[0] == name for c in calls) - 1) % len(series)]
        timing = SimpleNamespace(ttft_s=t, stats=SimpleNamespace(fraction=0.5), prompt_tokens=512,
                                 cached_tokens=500 if kw.get("prefix_cache") else 0)
        return SimpleNamespace(text="Paris", timing=timing)

    monkeypatch.setattr(engine, "generate", fake_generate)
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["demo", "--length", "512", "--repeats", "3", "--procs", "0", "--threads", "1",
                 "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    model, _ = smollm2
    n_methods = 1 + len(demo_methods(model, 512))
    follow_up = [c for c in calls if c[0] == "NoneType"]  # the prefix-cache table: engine default method
    assert len(calls) - len(follow_up) == 4 * n_methods
    assert len(follow_up) == 1 + 2 * (3 + 1)  # the first question stored, then warm-up + 3 timed, with and without
    assert "A follow-up question over the cached document" in out
    assert [n for _, n in calls[:n_methods]] == [1] * n_methods  # one warm-up run each, first
    assert [n for _, n in calls[n_methods:2 * n_methods]] == [5] * n_methods  # the first timed run answers
    assert "median and range of 3 runs" in out
    assert "5.000 [4.000, 6.000]" in out  # full prefill: the warm-up's 9.0 is not counted
    assert "2.500 [2.000, 3.000]" in out and "2.00x [2.00, 2.00]" in out  # ratios 2.0, 2.0, 2.0
