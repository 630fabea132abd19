"""The anchors' summary pairs each peer run with fastprefill's run of the same round, prompt, kind and
repeat, takes the median of those ratios per round and the median (and min-max) over rounds;
``run_all.sh`` runs every system once per round, the order rotating, into one file per round."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from figures.families import anchors_summarize
from tests import REPO

ANCHORS = REPO / "benchmarks" / "anchors"
summarize = anchors_summarize()


def _write(path, system, runs, cpu="Intel(R) Xeon(R) Processor", units="amx_bf16"):
    lines = [{"type": "header", "system": system, "version": "1", "model": "m", "dtype": "bfloat16", "threads": 2,
              "cpu": cpu, "bf16_units": units, "command": f"{system}_run.py", "started": "2026-11-27T10:00:00+0000"}]
    for prompt, kind, ttft in runs:
        lines.append({"type": "run", "system": system, "model": "m", "prompt_id": prompt, "length": 2048,
                      "prompt_tokens": 2000, "kind": kind, "repeat": 0, "ttft_s": ttft, "own_ttft_s": None,
                      "first_token": 7, "cached_tokens": 1900 if kind == "hit" else 0})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_ratios_pair_runs_within_a_round_and_take_the_median_over_rounds(tmp_path):
    # fastprefill drifts between rounds (round 1 is slow on prompt a): only pairing within the round sees it
    fp = {0: (1.0, 2.0), 1: (2.0, 2.0), 2: (1.0, 1.0)}
    peer = {0: (1.5, 2.0), 1: (2.2, 2.4), 2: (1.3, 1.3)}
    files = []
    for r in range(3):
        files.append(_write(tmp_path / f"run-fastprefill-round{r}.jsonl", "fastprefill",
                            [("a", "cold", fp[r][0]), ("b", "cold", fp[r][1])]))
        files.append(_write(tmp_path / f"run-peer-round{r}.jsonl", "peer",
                            [("a", "cold", peer[r][0]), ("b", "cold", peer[r][1])]))
    headers, runs = summarize.load(files)
    assert sorted({r["round"] for r in runs}) == [0, 1, 2]
    assert summarize.paired_ratios(runs, "m", 2048, "cold", "peer") == {0: [1.5, 1.0], 1: [1.1, 1.2], 2: [1.3, 1.3]}
    c = summarize.cell(runs, "m", 2048, "cold", "peer")
    assert c["ratio_rounds"] == pytest.approx([1.25, 1.15, 1.3])
    assert (c["ratio"], c["low"], c["high"]) == pytest.approx((1.25, 1.15, 1.3))
    assert (c["n"], c["rounds"]) == (6, 3)
    assert c["median_s"] == pytest.approx(1.75)
    assert c["spread"] == pytest.approx((2.3 - 1.3) / 1.75)  # round medians 1.75, 2.3, 1.3
    ref = summarize.cell(runs, "m", 2048, "cold", "fastprefill")
    assert (ref["ratio"], ref["low"], ref["high"]) == (1.0, 1.0, 1.0)
    text = summarize.report(headers, runs)
    assert "| m | 2048 | cold | peer | 1 | bfloat16 | 3 | 6 | 2000 | 1750.0 | - | 1.25 | [1.15, 1.30] | 57% | - | 6/6 |" in text
    assert "Machine: Intel(R) Xeon(R) Processor, AMX-BF16, 2 threads (fastprefill, peer)." in text
    assert "3 rounds" in text


def test_one_round_says_so_and_gives_no_interval(tmp_path):
    files = [_write(tmp_path / "run-fastprefill.jsonl", "fastprefill", [("a", "hit", 0.2)], cpu="AMD EPYC", units="none"),
             _write(tmp_path / "run-peer.jsonl", "peer", [("a", "hit", 0.3)], cpu="AMD EPYC", units="none")]
    headers, runs = summarize.load(files)
    c = summarize.cell(runs, "m", 2048, "hit", "peer")
    assert c["ratio"] == pytest.approx(1.5) and c["low"] is None and c["spread"] is None
    text = summarize.report(headers, runs)
    assert "One round" in text and "no interval" in text and "AMD EPYC, no bf16 units" in text


def test_run_all_runs_every_system_once_per_round_in_rotating_order(tmp_path):
    """run_all.sh with two stand-in runners (same interface: --model-dir --prompts --threads
    --repeats --out) writes one file per system and round and a summary over all rounds."""
    here = tmp_path / "anchors"
    here.mkdir()
    for name in ("run_all.sh", "summarize.py"):
        (here / name).write_text((ANCHORS / name).read_text())
    runner = '''import argparse, json, sys, time
p = argparse.ArgumentParser()
for a in ("--model-dir", "--prompts", "--threads", "--repeats", "--out", "--decode-tokens", "--name"):
    p.add_argument(a)
a = p.parse_args()
assert a.decode_tokens == "32"
with open(sys.argv[0] + ".order", "a") as f:
    f.write(a.out + "\\n")
with open(a.out, "w") as f:
    f.write(json.dumps({"type": "header", "system": a.name or "SYS", "model": "m", "threads": 2, "cpu": "c",
                        "command": " ".join(sys.argv), "started": "2026-11-27T10:00:00+0000"}) + "\\n")
    f.write(json.dumps({"type": "run", "system": a.name or "SYS", "model": "m", "prompt_id": "p", "length": 8,
                        "prompt_tokens": 8, "kind": "cold", "repeat": 0, "ttft_s": TTFT,
                        "first_token": 1}) + "\\n")
'''
    for system, ttft in (("fastprefill", "0.5"), ("peer", "1.0")):
        (here / f"{system}_run.py").write_text(runner.replace("SYS", system).replace("TTFT", ttft))
    venv = tmp_path / "venvs" / "peer" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    out = tmp_path / "out"
    out.mkdir()
    (out / "prompts.jsonl").write_text("{}\n")
    env = {**os.environ, "ROUNDS": "3", "SYSTEMS": "fastprefill peer fastprefill_lazy", "ANCHORS_VENVS": str(tmp_path / "venvs"),
           "FASTPREFILL_PYTHON": sys.executable, "FASTPREFILL_CACHE_DIR": str(tmp_path)}
    (here / "run_all.sh").chmod((here / "run_all.sh").stat().st_mode | stat.S_IXUSR)
    done = subprocess.run(["bash", str(here / "run_all.sh"), "m", str(out)], check=False, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.glob("run-*.jsonl")) == [
        f"run-{s}-round{r}.jsonl" for s in ("fastprefill", "fastprefill_lazy", "peer") for r in range(3)]
    order = [line.rsplit("/", 1)[1] for line in ((here / "fastprefill_run.py.order").read_text()
                                                 + (here / "peer_run.py.order").read_text()).split()]
    assert order.count("run-peer-round1.jsonl") == 1
    # round 1 starts with the second system: its peer file is older than its fastprefill file
    assert (out / "run-peer-round1.jsonl").stat().st_mtime_ns <= (out / "run-fastprefill-round1.jsonl").stat().st_mtime_ns
    summary = (out / "summary.md").read_text()
    assert "3 rounds" in summary and "| m | 8 | cold | peer | ? |  | 3 | 3 | 8 | 1000.0 | - | 2.00 | [2.00, 2.00] | 0% |" in summary
    # fastprefill_<row> ran fastprefill's runner under its own name
    assert "| m | 8 | cold | fastprefill_lazy | ? |  | 3 | 3 | 8 | 500.0 | - | 1.00 |" in summary


_SERVED = """import json, os, sys
import common

clock = [0.0]
common.time.perf_counter = lambda: clock[0]
LOG = sys.argv[0] + ".calls"


class Fake(common.System):
    name = "SYS"
    rounds = 0

    def load(self, max_prompt_tokens):
        with open(LOG, "a") as f:
            f.write("load\\n")

    def reset(self):
        pass

    def generate_one(self, prepared):
        with open(LOG, "a") as f:
            f.write(json.dumps(prepared) + "\\n")
        if prepared == [1, 2, 3]:  # the measured pair's first prompt: a new round
            Fake.rounds += 1
            if Fake.rounds > FAIL_AFTER:
                raise RuntimeError("this system breaks in its second round")
        clock[0] += TTFT
        return 5

    def inspect(self, raw, ids):
        return {"first_token": raw}


raise SystemExit(common.main(Fake))
"""


def _served_anchors(tmp_path):
    """The anchors folder with two stand-in --serve runners (the peer breaks in its second round),
    a model folder and a prompt set with one warm-up and one measured pair; (folder, output folder)."""
    here = tmp_path / "anchors"
    here.mkdir()
    for name in ("run_all.sh", "summarize.py", "rounds.py", "common.py"):
        (here / name).write_text((ANCHORS / name).read_text())
    for system, ttft, fail in (("fastprefill", "0.5", "99"), ("peer", "1.0", "1")):
        (here / f"{system}_run.py").write_text(
            _SERVED.replace("SYS", system).replace("TTFT", ttft).replace("FAIL_AFTER", fail))
    venv = tmp_path / "venvs" / "peer" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "fastprefill.json").write_text(json.dumps({"name": "m"}))
    out = tmp_path / "out"
    out.mkdir()
    pair = {"first": {"ids": [1, 2, 3]}, "followup": {"ids": [1, 2, 4]}}
    warm = {"first": {"ids": [9, 9, 3]}, "followup": {"ids": [9, 9, 4]}}
    (out / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [
        {"type": "header", "model": "m"},
        {"type": "prompt", "length": 8, "role": "warmup", "id": "w", "shared_prefix_tokens": 2, **warm},
        {"type": "prompt", "length": 8, "role": "measure", "id": "p", "shared_prefix_tokens": 2, **pair}]))
    return here, out


def test_persistent_rounds_load_and_warm_up_once_and_leave_out_a_system_that_breaks(tmp_path):
    """run_all.sh with PERSISTENT=1: each runner (common.main on a stand-in system) starts once with
    --serve, loads and runs its warm-up pair once, then one round per request into its own file with
    its own header; the order rotates; a system that fails in round 1 loses that round's partial
    file and the later rounds, the others go on, and the run reports the failure."""
    here, out = _served_anchors(tmp_path)
    env = {**os.environ, "ROUNDS": "3", "SYSTEMS": "fastprefill peer", "PERSISTENT": "1", "DECODE": "0",
           "ANCHORS_VENVS": str(tmp_path / "venvs"), "FASTPREFILL_PYTHON": sys.executable,
           "FASTPREFILL_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(here / "run_all.sh"), "m", str(out)], check=False, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "peer FAILED in round 1" in done.stderr, done.stderr
    assert sorted(p.name for p in out.glob("run-*.jsonl")) == [
        *(f"run-fastprefill-round{r}.jsonl" for r in range(3)), "run-peer-round0.jsonl"]
    calls = (here / "fastprefill_run.py.calls").read_text().split("\n")[:-1]
    assert calls == ["load", "[9, 9, 3]", "[9, 9, 4]", *["[1, 2, 3]", "[1, 2, 4]"] * 3]
    assert "RuntimeError: this system breaks" in (out / "run-peer.log").read_text()
    for r in range(3):
        lines = [json.loads(x) for x in (out / f"run-fastprefill-round{r}.jsonl").read_text().splitlines()]
        assert lines[0]["serve_round"] == r and "--serve" in lines[0]["command"]
        assert [(x["kind"], x["ttft_s"]) for x in lines[1:]] == [("cold", 0.5), ("hit", 0.5)]
    # round 1 starts with the second system: the peer was asked (and broke) before fastprefill ran
    peer_broke = (out / "run-peer.log").stat().st_mtime_ns
    assert peer_broke <= (out / "run-fastprefill-round1.jsonl").stat().st_mtime_ns
    summary = (out / "summary.md").read_text()
    assert "stayed up across the rounds" in summary
    assert "| m | 8 | cold | peer | ? |  | 1 | 1 | 3 | 1000.0 | - | 2.00 | - |" in summary


def test_persistent_rounds_stop_before_timing_where_memory_is_short(tmp_path):
    """rounds.run stops with a message naming the memory left and what to do, before any round
    (no run file), where the loaded systems leave less than the floor; the processes are stopped."""
    here, out = _served_anchors(tmp_path)
    import rounds  # beside summarize.py, which anchors_summarize() put on the path
    base = f"--model-dir {tmp_path / 'models' / 'm'} --prompts {out / 'prompts.jsonl'} --decode-tokens 0"
    systems = [(n, f"{sys.executable} {here / (n + '_run.py')} {base}") for n in ("fastprefill", "peer")]
    with pytest.raises(SystemExit, match="GiB of memory is left with every system loaded.*--kv-cache-gib"):
        rounds.run(systems, out, 2, min_free_gib=1e9)
    assert not list(out.glob("run-*-round*.jsonl"))
    assert (here / "fastprefill_run.py.calls").read_text().split() == ["load", "[9,", "9,", "3]", "[9,", "9,", "4]"]


def test_runs_of_another_sitting_are_not_paired(tmp_path):
    """A peer run that began hours from fastprefill's run of the same round is not divided by it:
    its row keeps its own medians and gives no ratio, and the summary says why."""
    fp = _write(tmp_path / "run-fastprefill.jsonl", "fastprefill", [("a", "cold", 1.0)])
    peer = tmp_path / "run-peer.jsonl"
    _write(peer, "peer", [("a", "cold", 2.0)])
    lines = peer.read_text().splitlines()
    head = json.loads(lines[0])
    head["started"] = "2026-11-26T10:00:00+0000"  # the day before
    peer.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    headers, runs = summarize.load([fp, str(peer)])
    assert summarize.other_sittings(headers) == {(0, "m", "peer")}
    c = summarize.cell(runs, "m", 2048, "cold", "peer", summarize.other_sittings(headers))
    assert c["ratio"] is None and c["median_s"] == pytest.approx(2.0)
    text = summarize.report(headers, runs)
    assert "Not paired" in text and "| m | 2048 | cold | peer | 1 | bfloat16 | 1 | 1 | 2000 | 2000.0 | - | - | - |" in text


def test_decode_rows_compare_steps_and_all_tokens(tmp_path):
    """A decode run is compared by its step (not a TTFT) and agrees only when every token does;
    its rows come after the hit rows."""
    def write(path, system, step, tokens):
        _write(path, system, [("a", "cold", 1.0), ("a", "hit", 0.1)])
        with open(path, "a") as f:
            f.write(json.dumps({"type": "run", "system": system, "model": "m", "prompt_id": "a", "length": 2048,
                                "prompt_tokens": 2010, "kind": "decode", "repeat": 0, "step_s": step,
                                "own_step_s": step / 2, "tokens": tokens, "first_token": tokens[0]}) + "\n")
        return str(path)

    files = [write(tmp_path / "run-fastprefill-round0.jsonl", "fastprefill", 0.040, [7, 1, 2]),
             write(tmp_path / "run-peer-round0.jsonl", "peer", 0.050, [7, 1, 3])]
    headers, runs = summarize.load(files)
    c = summarize.cell(runs, "m", 2048, "decode", "peer")
    assert c["ratio"] == pytest.approx(1.25) and c["median_s"] == pytest.approx(0.05)
    assert c["own_s"] == pytest.approx(0.025)
    # two systems of the same rounds paired with each other, neither of them fastprefill's reference row
    assert summarize.cell(runs, "m", 2048, "decode", "fastprefill", reference="peer")["ratio"] == pytest.approx(0.8)
    text = summarize.report(headers, runs)
    assert "| m | 2048 | decode | peer | 1 | bfloat16 | 1 | 1 | 2010 | 50.0 | 25.0 | 1.25 | - | - | - | 0/1 |" in text
    rows = [line.split(" | ")[2] for line in text.splitlines() if line.startswith("| m | 2048")]
    assert rows == ["cold", "cold", "hit", "hit", "decode", "decode"]


def test_the_protocol_times_a_decode_step_as_a_difference_of_two_calls(tmp_path, monkeypatch):
    """common.main on a fake system: per pair a cold, a hit and a decode run; the step is
    (wall of 1 + D tokens - wall of 1 token) / D, so the per-call cost cancels."""
    import common  # beside summarize.py, which anchors_summarize() put on the path

    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

    class Fake(common.System):
        name = "fake"

        def load(self, max_prompt_tokens):
            pass

        def reset(self):
            pass

        def generate_one(self, prepared):
            clock[0] += 0.5
            return 3

        def inspect(self, raw, ids):
            return {"first_token": raw}

        def generate_n(self, prepared, n):
            clock[0] += 0.2 + 0.01 * (n - 1)  # a fixed call cost, then 10 ms per step
            return list(range(n))

        def inspect_n(self, raw):
            return {"tokens": raw, "own_step_s": 0.009}

    prompts = tmp_path / "prompts.jsonl"
    pair = {"first": {"ids": [1, 2, 3]}, "followup": {"ids": [1, 2, 4]}}
    prompts.write_text("".join(json.dumps(x) + "\n" for x in [
        {"type": "header", "model": "m"},
        {"type": "prompt", "length": 8, "role": "warmup", "id": "w", "shared_prefix_tokens": 2, **pair},
        {"type": "prompt", "length": 8, "role": "measure", "id": "p", "shared_prefix_tokens": 2, **pair}]))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "fastprefill.json").write_text(json.dumps({"name": "m"}))
    out = tmp_path / "out.jsonl"
    argv = ["x", "--model-dir", str(tmp_path / "m"), "--prompts", str(prompts), "--repeats", "1",
            "--decode-tokens", "4", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert common.main(Fake) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["decode_tokens"] == 4
    runs = lines[1:]
    assert [r["kind"] for r in runs] == ["cold", "hit", "decode"]
    step = runs[2]
    assert step["step_s"] == pytest.approx(0.01) and step["own_step_s"] == 0.009
    assert step["tokens"] == [0, 1, 2, 3, 4] and step["prompt_tokens"] == 3

    monkeypatch.setattr(sys, "argv", [*argv[:-4], "--decode-tokens", "0", "--out", str(out)])
    assert common.main(Fake) == 0
    assert [json.loads(x)["kind"] for x in out.read_text().splitlines()[1:]] == ["cold", "hit"]
