"""The model zoo over the packages installed here: each entry's files are in its packages, and the
cached smollm2-135m equals the GGUF it was converted from."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastprefill.errors import MissingPackageError
from fastprefill.models import gguf, zoo
from fastprefill.models.pretrained import load_pretrained


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_installed_packages_match_the_registry(name):
    """Each entry's files exist in its installed packages and the first one starts a GGUF."""
    entry = zoo.ZOO[name]
    try:
        paths = zoo.locate_files(entry)
    except MissingPackageError as exc:
        pytest.skip(f"packages not installed: {exc.pip_command}")
    assert len(paths) == len(entry.packages)
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    with open(paths[0], "rb") as f:
        assert f.read(4) == gguf.GGUF_MAGIC



@pytest.mark.integration
def test_smollm2_cache_gives_the_gguf_logits():
    """The cached smollm2-135m (prepared once into the default cache) equals the GGUF it came from."""
    entry = zoo.ZOO["smollm2-135m"]
    try:
        (gguf_path,) = zoo.locate_files(entry)
    except MissingPackageError as exc:
        pytest.skip(str(exc))
    model, tokenizer = load_pretrained("smollm2-135m", dtype="float32")  # the conversion is exact in float32
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    text = "def fibonacci(n):\n    # return the n-th Fibonacci number"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tokenizer(text, return_tensors="pt").input_ids.tolist()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
