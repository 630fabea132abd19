"""The command line as scripts use it: piped tables, ``--json``, binary input, ``serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from fastprefill.cli import main
from fastprefill.distributed.runtime import free_port
from fastprefill.engine import generate
from fastprefill.models import zoo

SRC = str(Path(__file__).resolve().parents[1] / "src")


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
def test_generate_json_equals_the_engine(capsys, smollm2):
    model, tok = smollm2
    assert main(["generate", "--json", "--max-new-tokens", "4", "--threads", "2", "What is 2+2?"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = generate(model, tok, "What is 2+2?", None, 4, chat=True)
    assert got["text"] == want.text and got["token_ids"] == want.token_ids
    assert got["method"] == "full" and got["model"] == "smollm2-135m"
    assert got["timing"]["prompt_tokens"] == want.timing.prompt_tokens and got["timing"]["ttft_s"] > 0


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
@pytest.mark.timeout(600)
def test_serve_command_answers_over_http(smollm2):
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
        model, tok = smollm2
        assert r.choices[0].message.content == generate(model, tok, "Hi!", None, 3, chat=True).text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read().decode()
