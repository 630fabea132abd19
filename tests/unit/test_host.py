"""The dtype choice: ``auto`` follows the CPU's bfloat16 units (forced both ways here, so the suite
passes on any machine), names are checked, and the choice reaches the loader, the records and the
tuning profiles."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fastprefill import host
from fastprefill.bench.records import RecordLog, environment
from fastprefill.errors import ConfigError
from fastprefill.methods.auto import ProfileBucket, Target, TuneProfile
from fastprefill.methods.registry import make_method
from fastprefill.models import load
from fastprefill.models.fingerprint import weights_fingerprint
from fastprefill.models.random import random_model

AMX = {"cpu_name": "test cpu", "amx_bf16": True, "avx512_bf16": True}
AVX512_BF16_ONLY = {"cpu_name": "test cpu", "amx_bf16": False, "avx512_bf16": True}
NO_BF16_UNITS = {"cpu_name": "test cpu", "amx_bf16": False, "avx512_bf16": False}


@pytest.fixture
def cpu_flags(monkeypatch):
    """``cpu_flags(flags)`` makes :func:`host.cpu_info` read ``flags`` (the detection forced)."""
    def force(flags: dict) -> None:
        monkeypatch.setattr(host, "_cpu_flags", lambda: dict(flags))
        host.cpu_info.cache_clear()

    yield force
    host.cpu_info.cache_clear()


@pytest.mark.parametrize(("flags", "want", "units"), [
    (AMX, torch.bfloat16, "amx_bf16"),
    (AVX512_BF16_ONLY, torch.bfloat16, "avx512_bf16"),
    (NO_BF16_UNITS, torch.float32, "none"),
])
def test_auto_is_bfloat16_only_on_native_units(cpu_flags, flags, want, units):
    cpu_flags(flags)
    assert host.cpu_info().bf16_units == units
    assert host.auto_dtype("cpu") == want and host.resolve_dtype("auto") == want and host.resolve_dtype(None) == want
    model, _ = load("random:llama")  # the loader's default is auto
    assert model.dtype == want
    assert load("random:llama", dtype="float32")[0].dtype == torch.float32  # an explicit choice wins
    assert load("random:llama", dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_bfloat16_asked_for_without_native_units_is_loaded_with_a_warning(cpu_flags, monkeypatch):
    from fastprefill import models

    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: models.random_models.load(
        "random:llama", dtype=k["dtype"]))
    cpu_flags(NO_BF16_UNITS)
    with pytest.warns(UserWarning, match="without native bfloat16 matrix units .*dtype='auto' picks float32"):
        assert load("smollm2-135m", dtype="bfloat16", compile=False)[0].dtype == torch.bfloat16
    cpu_flags(AMX)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load("smollm2-135m", dtype="bfloat16", compile=False)
        cpu_flags(NO_BF16_UNITS)
        assert load("smollm2-135m", compile=False)[0].dtype == torch.float32  # auto: no warning


def test_auto_on_a_device_without_bfloat16_units_is_float32():
    assert host.auto_dtype("meta") == torch.float32


@pytest.mark.parametrize("bad", ["float64", "bf16", "int8", torch.int64, 3])
def test_unknown_dtypes_are_refused_naming_the_choices(bad):
    with pytest.raises(ConfigError, match="auto, bfloat16, float32, float16"):
        host.resolve_dtype(bad)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load("random:llama", dtype=bad)


def test_precision_is_written_in_every_record_header(cpu_flags, tmp_path):
    cpu_flags(NO_BF16_UNITS)
    header = environment(2, random_model("llama", dtype=torch.bfloat16))
    assert header["dtype"] == "bfloat16" and header["bf16_native"] is False and header["bf16_units"] == "none"
    assert environment(2, torch.float32)["dtype"] == "float32"
    cpu_flags(AMX)
    assert environment(2, torch.float32)["bf16_units"] == "amx_bf16"


def test_a_resumed_record_file_must_have_the_same_dtype(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"header": {"task": "t"}}) + "\n")  # written before dtypes were recorded
    RecordLog(path, {"task": "t", "dtype": "float32"}, resume=True, match=("task", "dtype"))  # float32 then
    with pytest.raises(ConfigError, match="dtype='float32', not 'bfloat16'"):
        RecordLog(path, {"task": "t", "dtype": "bfloat16"}, resume=True, match=("task", "dtype"))


def test_a_profile_measured_in_another_dtype_is_refused(tmp_path, tiny_llama, tiny_bf16):
    assert weights_fingerprint(tiny_bf16["llama"]) == weights_fingerprint(tiny_llama)  # one checkpoint
    profile = TuneProfile(model="tiny", fingerprint=weights_fingerprint(tiny_llama), tokenizer_fingerprint="t",
                          target=Target("first-token", 0.7), buckets=(ProfileBucket("all", None, "full"),),
                          dtype="float32")
    auto = make_method(f"auto:profile={profile.save(tmp_path / 'p.json')}")
    auto.check_model(tiny_llama)
    with pytest.raises(ConfigError, match=r"measured in float32 and this model runs in bfloat16: load the model "
                                          r"with --dtype float32, or tune it in bfloat16"):
        auto.check_model(tiny_bf16["llama"])
    old = json.loads((tmp_path / "p.json").read_text())
    del old["dtype"]  # a profile written before dtypes were recorded was measured in float32
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert TuneProfile.load(tmp_path / "old.json").dtype == "float32"


def test_keep_freed_memory_is_idempotent():
    first = host.keep_freed_memory()
    assert host.keep_freed_memory() == first
    assert host.precision_report(torch.float32)["freed_memory_kept"] == first


def test_auto_on_a_cuda_device_is_bfloat16_where_it_is_supported(cpu_flags, monkeypatch):
    cpu_flags(NO_BF16_UNITS)  # the CPU's units do not matter for a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert host.auto_dtype("cuda") == host.resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert host.resolve_dtype("float32", "cuda") == torch.float32  # an explicit choice wins
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert host.auto_dtype("cuda") == torch.float32


def test_a_cuda_header_names_the_gpu_driver_and_versions(monkeypatch):
    from types import SimpleNamespace

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(host, "_cuda_driver", lambda index: "580.65.06")
    report = host.accelerator_report("cuda:0")
    assert report is not None and report["gpu"] == "NVIDIA H100 80GB HBM3" and report["gpu_memory_gib"] == 80.0
    assert report["driver"] == "580.65.06" and report["compute_capability"] == "9.0"
    assert report["cuda"] == torch.version.cuda and report["gpus"] == 1
    assert host.accelerator_report("cpu") is None
    assert host.accelerator_report("meta") == {"device_type": "meta"}
    assert "accelerator" not in environment(2, torch.float32)  # a CPU header is unchanged


def _status_kib(key: str = "VmLck") -> int:
    """A ``/proc/self/status`` value of this process (``VmLck``, ``RssAnon``), in KiB."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key + ":"))
    return int(line.split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlock is Linux's")
def test_locking_tensors_locks_each_storage_once_and_unlocking_gives_it_back():
    """Two tensors and a view of the first: each storage's pages locked once (the view adds
    nothing), counted by the kernel (VmLck), a oneDNN packed copy (no storage) skipped, and all
    of it unlocked again."""
    page = os.sysconf("SC_PAGE_SIZE")
    a, b = torch.ones(3 << 20, dtype=torch.uint8), torch.ones(1 << 20, dtype=torch.float32)
    extra = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 4), 8)] if torch.backends.mkldnn.is_available() else []
    before = _status_kib()
    try:
        locked = host.lock_in_memory([a, a[10:], b, *extra])
    except ConfigError as e:  # a host whose limit (ulimit -l) is below a few MiB
        pytest.skip(str(e))
    spans = [(t.data_ptr() // page * page, -(-(t.data_ptr() + t.untyped_storage().nbytes()) // page) * page) for t in (a, b)]
    pages = {p for start, end in spans for p in range(start, end, page)}  # adjacent storages merge into one range
    assert len(locked.ranges) <= 2 and locked.bytes == len(pages) * page
    assert _status_kib() - before == locked.bytes // 1024
    locked.unlock()
    assert _status_kib() == before and locked.bytes == 0
    locked.unlock()  # idempotent


def test_a_refused_lock_says_how_to_fix_it_and_leaves_nothing_locked(monkeypatch):
    """The kernel refusing the second range: ConfigError naming the size, the reason and ``ulimit -l``,
    and the first range unlocked again."""
    calls: list[tuple[str, int]] = []

    def mlock(addr: int, length: int) -> int:
        calls.append(("lock", addr))
        if len(calls) == 1:
            return 0
        ctypes.set_errno(errno.ENOMEM)
        return -1

    def munlock(addr: int, length: int) -> int:
        calls.append(("unlock", addr))
        return 0

    gib = 1 << 30
    monkeypatch.setattr(host, "_libc_memlock", lambda: (mlock, munlock))
    monkeypatch.setattr(host, "_page_ranges", lambda tensors: [(gib, gib + gib // 2), (4 * gib, 5 * gib)])
    monkeypatch.setattr(host.sys, "platform", "linux")
    with pytest.raises(ConfigError, match=r"could not lock 1\.50 GiB .*Cannot allocate memory.*ulimit -l"):
        host.lock_in_memory([torch.ones(1)])
    assert calls == [("lock", gib), ("lock", 4 * gib), ("unlock", gib)]
    monkeypatch.setattr(host.sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="needs Linux"):
        host.lock_in_memory([torch.ones(1)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlock is Linux's")
def test_locking_a_private_file_mapping_keeps_the_files_pages(tmp_path):
    """A tensor over a private, writable mapping of a file (as a float32 checkpoint's weights are)
    is locked as the file's pages: the process's own memory (RssAnon) does not grow by its size,
    as it would if the lock copied each page, and the values are the file's."""
    path, size = tmp_path / "weights.bin", 32 << 20
    path.write_bytes(b"\x07" * size)
    t = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    anon = _status_kib("RssAnon")
    try:
        locked = host.lock_in_memory([t])
    except ConfigError as e:
        pytest.skip(str(e))
    try:
        assert locked.bytes >= size and _status_kib() >= size // 1024
        assert _status_kib("RssAnon") - anon < size // 1024 // 4, "the lock copied the file's pages"
        assert int(t[:: 1 << 20].min()) == 7
    finally:
        locked.unlock()
