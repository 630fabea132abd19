"""KV-Runahead and the TSP baseline: exactness against single-process prefill, the frozen
partition plans and their search, the checked chain communication, bad input, and faults.

Multi-process tests share two module-scoped pools (2 ranks on the random Llama, 3 ranks on the
random Qwen2); the fault tests run last because a failure shuts a pool down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fastprefill
from fastprefill import launch
from fastprefill.distributed.pool import RankPool, RankPoolError
from fastprefill.engine import generate
from fastprefill.errors import ConfigError, ModelNotFoundError, PromptError, UnsupportedModelError
from fastprefill.methods.base import DistributedMethod
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.registry import make_method
from fastprefill.methods.runahead import (
    ChainComm,
    ChainCommError,
    CostModel,
    KVRunahead,
    PartitionPlan,
    PartitionTable,
    SequenceParallel,
    search_partition,
)
from fastprefill.methods.runahead.tables import TABLES_DIR, find_table
from fastprefill.models import load
from fastprefill.models.shape import ModelShape
from runahead_projection import single_s, tsp_s

ATOL = 1e-4
SHAPE_7B = ModelShape(32, 4096, 32, 32, 128, 11008, 32000, 4096)


def _reference(model, ids: list[int], n_new: int) -> tuple[torch.Tensor, list[int]]:
    """Single-process full prefill logits (V,) and HF greedy ids."""
    t = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(t).logits[0, -1].float()
    hf = model.generate(t, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)[0, len(ids):].tolist()
    return logits, hf


def _gone(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    return not any(alive(p) for p in pids)


# --- partitions -----------------------------------------------------------------------------------
def test_even_partition_and_prefixes():
    plan = PartitionPlan.even(10, 3)
    assert plan.chunks == (4, 3, 3) and plan.length == 10
    assert [plan.start(r) for r in range(3)] == [0, 4, 7]
    assert PartitionPlan.even(5, 5).chunks == (1,) * 5


def test_paper_example_counts():
    """9 tokens on 3 ranks: TSP 27 dot products per rank and 36 KV entries moved; KV-Runahead
    4/3/2 gives 21 on the busiest rank and 22 moved (K and V counted separately)."""
    plan = PartitionPlan((4, 3, 2), 9)
    assert [plan.attention_pairs(r) for r in range(3)] == [16, 21, 18]
    assert 2 * sum(plan.start(r) for r in range(1, 3)) == 22  # rank i receives the s_i rows before it
    tsp = SequenceParallel(procs=3)
    assert tsp._attention_pairs(PartitionPlan.even(9, 3)) == [27, 27, 27]
    assert 2 * 3 * (3 - 1) * 3 == 36  # each rank sends its 3 rows of K and V to 2 others


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: PartitionPlan.even(5, 0), "procs"),
        (lambda: PartitionPlan.even(3, 4), "larger than the prompt"),
        (lambda: PartitionPlan((3, 2), 6), "sum to 5"),
        (lambda: PartitionPlan((3, 0, 3), 6), "chunk 1"),
        (lambda: PartitionPlan(()), "at least one"),
        (lambda: KVRunahead(procs=0), "procs"),
        (lambda: KVRunahead(procs=2, partition="balanced"), "partition"),
        (lambda: KVRunahead(procs=2, partition=(3, 2, 1)), "3 chunks but procs=2"),
        (lambda: KVRunahead(procs=2, partition=(3, 0)), "chunk 1"),
        (lambda: KVRunahead(procs=2, timeout_s=0), "timeout_s"),
        (lambda: SequenceParallel(procs=-1), "procs"),
        (lambda: make_method("full:procs=2"), "no option"),
        (lambda: make_method("runahead:procs=2,partition=3:2"), "partition"),
        (lambda: make_method("runahead:procs=2,partition=3/x"), "partition"),
        (lambda: make_method("runahead:procs=2,partition=3/2/1"), "3 chunks but procs=2"),
        (lambda: make_method("runahead:procs=two"), "option 'procs': not an integer"),
        (lambda: make_method("tsp:procs=2,partition=even"), "no option"),
    ],
)
def test_bad_configuration(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_registry_builds_distributed_methods():
    ra = make_method("runahead:procs=2,partition=searched")
    assert isinstance(ra, KVRunahead) and isinstance(ra, DistributedMethod)
    assert (ra.procs, ra.partition) == (2, "searched")
    assert make_method("runahead:procs=2,partition=600/424").partition == (600, 424)
    tsp = make_method("tsp:procs=3,timeout_s=5")
    assert isinstance(tsp, SequenceParallel) and isinstance(tsp, DistributedMethod)
    assert (tsp.procs, tsp.timeout_s) == (3, 5.0)
    assert not isinstance(FullPrefill(), DistributedMethod)
    # defaults fill what the spec leaves out, only for the methods that declare them
    defaults = {"procs": 3, "partition": "2/1/1", "timeout_s": 9.0}
    assert make_method("runahead", defaults) == KVRunahead(procs=3, partition=(2, 1, 1), timeout_s=9.0)
    assert make_method("runahead:procs=2,partition=even", defaults) == KVRunahead(procs=2, timeout_s=9.0)
    assert make_method("tsp", defaults) == SequenceParallel(procs=3, timeout_s=9.0)
    assert isinstance(make_method("full", defaults), FullPrefill)


def test_random_models_are_seeded_and_the_fixtures_use_them(tiny_llama):
    state = torch.random.get_rng_state()
    model, tok = load("random:llama", dtype="float32")
    assert tok is None and torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    ours, fixture = model.state_dict(), tiny_llama.state_dict()
    assert ours.keys() == fixture.keys() and all(torch.equal(ours[k], fixture[k]) for k in ours)
    assert load("random:qwen2")[0].config.model_type == "qwen2"
    with pytest.raises(ModelNotFoundError, match="random:llama"):
        load("random:mamba")


def test_explicit_partition_must_sum_to_prompt(tiny_llama):
    with pytest.raises(ConfigError, match="sum to"):
        KVRunahead(procs=2, partition=(5, 5)).plan(tiny_llama, 11)
    with pytest.raises(ConfigError, match="larger than the prompt"):
        KVRunahead(procs=3).plan(tiny_llama, 2)


def test_search_gives_later_ranks_shorter_chunks_and_beats_even():
    cost = CostModel.from_flops(SHAPE_7B, 150e12, 300e9)
    for procs in (2, 3, 8):
        plan = search_partition(8192, procs, cost)
        assert plan.length == 8192 and min(plan.chunks) >= 1
        assert list(plan.chunks) == sorted(plan.chunks, reverse=True)
        assert cost.runahead_s(plan.chunks) < cost.runahead_s(PartitionPlan.even(8192, procs).chunks)
        assert cost.runahead_s(plan.chunks) < tsp_s(cost, 8192, procs) < single_s(cost, 8192)
    # one rank: TSP and the chain are plain prefill, L * (overhead + linear + causal pairs) + head
    plain = cost.num_layers * (cost.layer_overhead_s + cost.linear_s_per_token * 8192
                               + cost.attn_s_per_pair * 8192 * 8193 / 2) + cost.head_s
    assert tsp_s(cost, 8192, 1) == single_s(cost, 8192) == pytest.approx(plain, rel=1e-12)
    # no local move of a single token improves the searched plan
    plan = search_partition(1000, 3, cost)
    best = cost.runahead_s(plan.chunks)
    for a in range(3):
        for b in range(3):
            if a != b and plan.chunks[a] > 1:
                c = list(plan.chunks)
                c[a] -= 1
                c[b] += 1
                assert cost.runahead_s(c) >= best - 1e-12


def test_table_roundtrip_and_interpolation(tmp_path):
    cost = CostModel.from_flops(SHAPE_7B, 150e12, 10e9)
    table = PartitionTable.build("llama-7b", SHAPE_7B, cost, ranks=(2,), lengths=(1024, 4096))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json()))
    back = PartitionTable.load(path)
    assert back.matches(SHAPE_7B) and back == table
    at_1k, at_4k, mid = back.plan(1024, 2), back.plan(4096, 2), back.plan(2048, 2)
    assert at_1k.chunks == search_partition(1024, 2, cost).chunks
    f = [p.chunks[0] / p.length for p in (at_1k, mid, at_4k)]
    assert min(f[0], f[2]) - 1e-3 <= f[1] <= max(f[0], f[2]) + 1e-3  # interpolated in between
    assert back.plan(100_000, 2).length == 100_000 and back.plan(300, 3).length == 300  # clamp; search
    assert find_table(SHAPE_7B, tmp_path) == back
    with pytest.raises(ConfigError, match="cannot read"):
        PartitionTable.load(tmp_path / "missing.json")


def test_shipped_tables_parse_and_plan():
    paths = sorted(TABLES_DIR.glob("*.json"))
    assert {p.stem for p in paths} >= {"smollm2-135m", "qwen2.5-coder-0.5b"}
    for p in paths:
        table = PartitionTable.load(p)
        assert table.command.startswith("fastprefill calibrate-runahead")
        for n in (512, 3000, 8192):
            plan = table.plan(n, 2)
            assert plan.length == n and plan.chunks[0] >= plan.chunks[1]


def test_calibration_fits_a_cost_model_and_the_command_writes_its_table(tiny_llama, tmp_path, monkeypatch):
    """``calibrate`` fits the compute coefficients on the model and takes the communication ones
    as given; ``fastprefill calibrate-runahead`` measures those (here stubbed: it starts two
    processes), searches and writes a table that loads and records the command."""
    from fastprefill.cli import main
    from fastprefill.methods.runahead.calibrate import calibrate

    cost = calibrate(tiny_llama, bandwidth_bytes_s=1e9, latency_s=1e-5, chunks=(8, 16), prefixes=(0, 16), repeats=1,
                     progress=False)
    assert cost.bandwidth_bytes_s == 1e9 and cost.latency_s == 1e-5 and cost.num_layers == tiny_llama.config.num_hidden_layers
    monkeypatch.setattr("fastprefill.distributed.loopback.measure_loopback", lambda: (1e9, 1e-5))
    monkeypatch.setattr("fastprefill.models.load", lambda name: (tiny_llama, None))
    out = tmp_path / "table.json"
    assert main(["calibrate-runahead", "--model", "tiny", "--out", str(out), "--ranks", "2", "--lengths", "64",
                 "--repeats", "1"]) == 0
    table = PartitionTable.load(out)
    assert table.command.startswith("fastprefill calibrate-runahead --model tiny") and table.plan(64, 2).length == 64


# --- communication object -----------------------------------------------------------------------------
def test_chain_comm_refuses_misuse():
    plan = PartitionPlan((4, 3, 2), 9)
    kw = {"kv_heads": 2, "head_dim": 8, "dtype": torch.float32, "device": torch.device("cpu")}
    first, mid, last = (ChainComm(plan, r, **kw) for r in range(3))
    with pytest.raises(ChainCommError, match="rank 0"):
        first.send_recv(0, recv=True)
    with pytest.raises(ChainCommError, match="last rank"):
        last.send_recv(0, send=(torch.zeros(1, 2, 9, 8), torch.zeros(1, 2, 9, 8)))
    with pytest.raises(ChainCommError, match=r"\(1, 2, 7, 8\)"):  # rank 1 sends s_2 = 7 rows
        mid.send_recv(0, send=(torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8)))
    with pytest.raises(ChainCommError, match="float32"):
        mid.send_recv(0, send=(torch.zeros(1, 2, 7, 8, dtype=torch.float64),) * 2)
    with pytest.raises(ChainCommError, match="nothing to commit|nothing queued"):
        mid.commit()
    with pytest.raises(ChainCommError, match="never queued"):
        mid.wait(0)
    mid.send_recv(3, recv=True)
    with pytest.raises(ChainCommError, match="already queued"):
        mid.send_recv(3, recv=True)
    with pytest.raises(ChainCommError, match="not committed"):
        mid.wait(3)
    with pytest.raises(ChainCommError, match="never committed"):
        mid.flush()
    with pytest.raises(ChainCommError, match="nothing to queue"):
        mid.send_recv(4)


# --- one process ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [KVRunahead(procs=1), SequenceParallel(procs=1)], ids=["runahead", "tsp"])
def test_single_rank_equals_full_prefill(tiny_model, method, make_ids):
    ids = make_ids(29, 4)[0].tolist()
    ref_logits, hf = _reference(tiny_model, ids, 6)
    out = method.prefill(tiny_model, torch.tensor([ids]))
    torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=0)
    res = generate(tiny_model, None, ids, method, max_new_tokens=6, stop_at_eos=False)
    assert res.token_ids == hf
    assert res.timing.stats.token_layers == 29 * 4 and res.timing.extra["chunks"] == [29]


def test_multi_rank_without_group_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="process group"):
        generate(tiny_llama, None, [1, 2, 3, 4], KVRunahead(procs=2))


# --- multi-process pools ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool2():
    with RankPool("random:llama", 2, dtype="float32", timeout_s=30, start_method="fork") as pool:
        yield pool


@pytest.fixture(scope="module")
def pool3():
    with RankPool("random:qwen2", 3, dtype="float32", timeout_s=30, start_method="fork") as pool:
        yield pool


def _check_pool(pool, family: str, ids: list[int], methods, n_new: int = 6) -> None:
    model, _ = load(f"random:{family}", dtype="float32")
    ref_logits, hf = _reference(model, ids, n_new)
    for method in methods:
        res = pool.generate(ids, method, n_new, stop_at_eos=False)
        assert res.logits is not None
        diff = float((res.logits - ref_logits).abs().max())
        assert diff <= ATOL, f"{method.describe()}: max |logit diff| {diff}"
        assert res.token_ids == hf, method.describe()
        assert res.ttft_s > 0
        chunks = res.ranks[-1]["chunks"]
        assert sum(chunks) == len(ids) and all(r["chunks"] == chunks for r in res.ranks)


def test_two_ranks_exact(pool2, make_ids):
    """37 tokens (odd) on 2 ranks: even, searched, a single-token last chunk, a single-token first."""
    methods = [KVRunahead(procs=2), KVRunahead(procs=2, partition="searched"),
               KVRunahead(procs=2, partition=(36, 1)), KVRunahead(procs=2, partition=(1, 36)),
               SequenceParallel(procs=2)]
    _check_pool(pool2, "llama", make_ids(37, 5)[0].tolist(), methods)
    _check_pool(pool2, "llama", make_ids(2, 6)[0].tolist(), [KVRunahead(procs=2)])  # one token per rank


def test_two_ranks_bytes_moved(pool2, make_ids):
    """Rank 0 sends exactly its chunk's K and V at every layer (4 layers, 2 KV heads, d=16)."""
    res = pool2.generate(make_ids(37, 7)[0].tolist(), KVRunahead(procs=2, partition=(20, 17)), 1,
                         stop_at_eos=False)
    per_row = 2 * 2 * 16 * 4  # K+V, heads, head_dim, float32 bytes
    assert res.ranks[0]["kv_bytes_sent_this_rank"] == 4 * 20 * per_row
    assert res.ranks[1]["kv_bytes_received_this_rank"] == 4 * 20 * per_row
    assert res.ranks[1]["kv_bytes_sent_this_rank"] == 0


def test_three_ranks_exact(pool3, make_ids):
    """37 tokens on 3 ranks (not divisible), even / searched / single-token chunks, and TSP."""
    methods = [KVRunahead(procs=3), KVRunahead(procs=3, partition="searched"),
               KVRunahead(procs=3, partition=(1, 1, 35)), KVRunahead(procs=3, partition=(35, 1, 1)),
               SequenceParallel(procs=3)]
    _check_pool(pool3, "qwen2", make_ids(37, 8)[0].tolist(), methods)


def test_pool_refuses_bad_requests_and_stays_usable(pool3, make_ids):
    with pytest.raises(ConfigError, match="larger than the prompt"):
        pool3.generate([1, 2], KVRunahead(procs=3), 2)
    with pytest.raises(ConfigError, match="procs=2"):
        pool3.generate([1, 2, 3, 4], KVRunahead(procs=2), 2)
    with pytest.raises(ConfigError, match="sum to"):
        pool3.generate([1, 2, 3, 4], KVRunahead(procs=3, partition=(1, 1, 1)), 2)
    _check_pool(pool3, "qwen2", make_ids(9, 9)[0].tolist(), [KVRunahead(procs=3)], n_new=2)


def test_pool_reports_user_errors_as_themselves_and_stays_usable(pool2, make_ids):
    with pytest.raises(PromptError, match="exceeds the model's context"):
        pool2.generate(make_ids(600, 3)[0].tolist(), KVRunahead(procs=2), 2)
    with pytest.raises(ConfigError, match="tokenizer"):
        pool2.generate("text, but random models have no tokenizer", SequenceParallel(procs=2), 2)
    with pytest.raises(ConfigError, match="runs on one process, but this group has 2"):
        pool2.generate([1, 2, 3], FullPrefill(), 2)
    _check_pool(pool2, "llama", make_ids(11, 4)[0].tolist(), [SequenceParallel(procs=2)], n_new=2)


def test_unsupported_family_is_refused_on_every_rank(make_ids):
    """random:gpt2 is no layer-loop family: every rank raises UnsupportedModelError before any
    communication, the driver re-raises it, and the ranks stay up for the next request."""
    with RankPool("random:gpt2", 2, timeout_s=30, start_method="fork") as pool:
        for method in (KVRunahead(procs=2), SequenceParallel(procs=2), KVRunahead(procs=2)):
            with pytest.raises(UnsupportedModelError, match="gpt2"):
                pool.generate(make_ids(8, 1)[0].tolist(), method, 2)
        assert not _gone(pool.pids)


def test_unknown_model_fails_at_start_with_its_own_error():
    with pytest.raises(ModelNotFoundError, match="mamba"):
        RankPool("random:mamba", 2, timeout_s=30, start_method="fork")


# --- faults (last: they shut the pools down) --------------------------------------------------------
def test_dead_rank_fails_every_rank_fast(pool3, make_ids):
    pids = pool3.pids
    t0 = time.monotonic()
    with pytest.raises(RankPoolError, match="rank 1"):
        pool3.generate(make_ids(30, 10)[0].tolist(), KVRunahead(procs=3, timeout_s=30), 4, fault=(1, 1, "exit"))
    assert time.monotonic() - t0 < 20
    assert _gone(pids)
    with pytest.raises(RankPoolError, match="closed"):
        pool3.generate([1, 2, 3], KVRunahead(procs=3), 1)


def test_hung_rank_times_out(pool2, make_ids):
    """Rank 0 hangs after layer 1: rank 1's bounded wait fails, the pool reports it and no
    worker survives."""
    pids = pool2.pids
    t0 = time.monotonic()
    with pytest.raises(RankPoolError, match=r"rank 1|timed out|did not answer"):
        pool2.generate(make_ids(30, 11)[0].tolist(), KVRunahead(procs=2, timeout_s=3), 4, fault=(0, 1, "hang"))
    assert time.monotonic() - t0 < 3 * 4 + 60
    assert _gone(pids)
    assert os.getpid() not in pids


# --- python -m fastprefill.launch: torchrun and the local pool ------------------------------------------
def _subprocess_env() -> dict[str, str]:
    """This interpreter's environment with this source tree first on the path, outside any torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    src = str(Path(fastprefill.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def test_torchrun_two_ranks_equal_full_prefill(tmp_path, make_ids):
    """``torchrun --standalone --nproc-per-node 2 -m fastprefill.launch`` (torchrun is
    ``python -m torch.distributed.run`` of this interpreter) with KV-Runahead (searched and
    uneven explicit partitions) and TSP in turn on the same two ranks: each method's first-token
    logits and tokens are single-process full prefill's, and only the last rank prints."""
    ids = make_ids(37, 12)[0].tolist()
    saved = tmp_path / "logits.pt"
    methods = ["runahead:partition=searched", "runahead:partition=30/7", "tsp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fastprefill.launch", "--model", "random:llama", "--prompt-ids", " ".join(map(str, ids)),
           *[x for m in methods for x in ("--method", m)], "--max-new-tokens", "4", "--timeout", "60", "--json",
           "--save-logits", str(saved), "--dtype", "float32"]
    proc = subprocess.run(cmd, check=False, env=_subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [o["method"] for o in outs] == ["runahead(procs=2, partition=searched)",
                                           "runahead(procs=2, partition=30/7)", "tsp(procs=2)"], proc.stdout
    model, _ = load("random:llama", dtype="float32")
    ref_logits, hf = _reference(model, ids, 4)
    for out, logits in zip(outs, torch.load(saved), strict=True):
        assert out["first_token_id"] == int(ref_logits.argmax()) and out["token_ids"] == hf
        assert (out["procs"], out["prompt_tokens"], out["ttft_clock"]) == (2, 37, "last rank") and out["ttft_s"] > 0
        diff = float((logits - ref_logits).abs().max())
        assert diff <= ATOL, f"{out['method']}: max |logit diff| {diff}"


class _ForkPool(RankPool):
    """RankPool started with ``fork`` (fast in tests; see RankPool's start_method)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "start_method": "fork"})


def test_launch_local_pool_json(capsys, tmp_path, monkeypatch, make_ids):
    monkeypatch.setattr("fastprefill.distributed.pool.RankPool", _ForkPool)
    ids = make_ids(21, 13)[0].tolist()
    argv = ["--model", "random:qwen2", "--prompt-ids", ",".join(map(str, ids)), "--method", "runahead:partition=15/6",
            "--procs", "2", "--max-new-tokens", "3", "--json", "--save-logits", str(tmp_path / "l.pt"),
            "--dtype", "float32"]
    assert launch.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    model, _ = load("random:qwen2", dtype="float32")
    ref_logits, hf = _reference(model, ids, 3)
    assert out["token_ids"] == hf and out["first_token_id"] == int(ref_logits.argmax())
    assert out["method"] == "runahead(procs=2, partition=15/6)" and out["ttft_clock"] == "driver"
    (logits,) = torch.load(tmp_path / "l.pt")
    assert float((logits - ref_logits).abs().max()) <= ATOL


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--method", "full", "--procs", "2"], "runs on one process, but --procs is 2"),
        (["--method", "runahead:procs=3", "--procs", "2"], "needs procs=3 ranks, but --procs is 2"),
        (["--method", "lazy"], "unknown method"),
        (["--device", "cuda"], "runs on CPU"),
        (["--prompt-ids", "1 x"], "--prompt-ids"),
        (["--threads", "0"], "threads_per_rank must be"),
    ],
)
def test_launch_refuses_bad_arguments_before_starting(capsys, argv, match):
    base = {"--model": "random:llama", "--prompt-ids": "1 2 3"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1]
    assert launch.main([x for kv in base.items() for x in kv]) == 2
    assert match in capsys.readouterr().err


def test_launch_under_torchrun_checks_every_method_before_any_work(capsys, monkeypatch):
    """``--method runahead --method full`` on 2 ranks: full is refused (exit 2) before the
    process group, the model or the first method's run."""
    def no_work(*_, **__):
        raise AssertionError("work started before every method was checked")

    for name in ("init_group", "use_loopback", "set_threads"):
        monkeypatch.setattr(launch, name, no_work)
    monkeypatch.setattr("fastprefill.models.load", no_work)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["--model", "random:llama", "--prompt-ids", "1 2 3", "--method", "runahead", "--method", "full"]
    assert launch.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and "full runs on one process, but torchrun started 2 ranks" in out.err


# --- the real model ---------------------------------------------------------------------------------
@pytest.mark.integration
def test_smollm2_two_ranks_exact(smollm2):
    model, tok = smollm2
    prompt = "Question: Which planet is known as the red planet, and why?\nAnswer:"
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        ref = FullPrefill().prefill(model, torch.tensor([ids])).logits
    want = generate(model, tok, ids, None, max_new_tokens=12)
    with RankPool("smollm2-135m", 2, dtype="float32", timeout_s=120) as pool:
        for method in (KVRunahead(procs=2), KVRunahead(procs=2, partition="searched"), SequenceParallel(procs=2)):
            res = pool.generate(ids, method, 12)
            assert float((res.logits - ref).abs().max()) <= ATOL, method.describe()
            assert res.token_ids == want.token_ids and res.text == want.text
