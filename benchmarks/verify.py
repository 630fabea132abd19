"""Recompute every committed figure from its records and report the values that differ.

Re-summarizes the result files in a results directory and compares them with their committed
summaries and tables (:func:`figures.results.verify_results`); for the checkout's own
``benchmarks/results`` also the README's summary table and the tables that the README and
``docs/`` quote from result files, with their paths, links and commands
(:func:`figures.pages.verify_pages`). No model is loaded.

Command (from anywhere in a checkout)::

    python benchmarks/verify.py                 # benchmarks/results, the README and docs/
    python benchmarks/verify.py OTHER_RESULTS   # only the result files of another directory

Exit status: 0 when every value reproduces, 1 when one differs, 2 when the directory is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastprefill.errors import ConfigError
from figures.pages import verify_pages
from figures.results import verify_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", default=str(RESULTS),
                    help="results directory (default: this checkout's benchmarks/results, which also checks "
                         "the figures of README.md and docs/)")
    args = ap.parse_args(argv)
    try:
        report = verify_results(args.results)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if Path(args.results).resolve() == RESULTS:
        pages = verify_pages(ROOT)  # the figures the README and docs/ print from these results
        report.checked += pages.checked
        report.mismatches += pages.mismatches
        for name in pages.quoted:  # a run with no summary of its own whose figures a page quotes
            if report.skipped.pop(name, None) is not None:
                report.checked.append(f"{name} (quoted by a page)")
    for name, reason in report.skipped.items():
        print(f"skipped {name}: {reason}")
    for mismatch in report.mismatches:
        print(f"differs {mismatch}", file=sys.stderr)
    print(f"{len(report.checked)} files checked, {len(report.mismatches)} values differ")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
