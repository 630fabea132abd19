"""Figures written in prose, each with a machine-readable source that :func:`check_prose` recomputes.

A page gives a figure its source in an HTML comment right after it (invisible when rendered)::

    bfloat16 is <figure>x<!-- src: cell("precision_qwen2.5-coder-0.5b_multidoc-qa_2048.jsonl", "paired speedup", method="bfloat16") --> faster

The comment holds one Python expression over the helpers of :func:`namespace` and the names a
page defines in ``<!-- let: P05 = "precision_....jsonl"; M = "qwen2.5-coder-0.5b" -->``; it sources the
last ``N`` numbers written before it (since the previous source or the start of the paragraph),
where ``N`` is the number of values it gives (a tuple gives several: ``<low>-<high>x<!-- src: (a, b) -->``).
Each number must print as its value does, to the precision it is written with (one decimal
written: the value rounded to one decimal). An expression that gives a string sources a label instead: the text before the comment must
end with it (a machine's name, :func:`machine_of`: ``Xeon, AMX-BF16, bfloat16``), or, written short,
name its CPU family and dtype (``on the EPYC in float32``).

Which numbers are figures (:func:`figures`): in prose, outside code, links, comments and the tables
that ``<!-- from: ... -->`` already checks, a number that has a decimal point or a unit (``x``,
``%``, ``s``, ``ms``, ``GB``...). Counts and settings (``50 prompts``, ``2 threads``), lengths
(``2k``), model sizes (``0.5B``), versions and dates are not; they may still be sourced.
:func:`unsourced` lists the figures no comment sources.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fastprefill.bench.records import read_rows
from fastprefill.errors import ConfigError
from figures.results import Mismatch, cell_matches

__all__ = ["Figure", "check_prose", "code_constant", "figures", "kv_cache_mb", "linear_weights_gb", "machine_of", "namespace",
           "sources", "unsourced"]

_SRC = re.compile(r"<!--\s*src:\s*(.*?)\s*-->", re.DOTALL)
#: ``<!-- let: P05 = "precision_....jsonl"; A = "..." -->``: names a page's sources may use
_LET = re.compile(r"<!--\s*let:\s*(.*?)\s*-->", re.DOTALL)
#: a table checked cell by cell follows a ``from:`` comment's line, or a ``checked:`` comment that ends
#: the line before it (the README's summary table: :mod:`figures.headline`)
_FROM = re.compile(r"^<!--\s*from:.*?-->[ \t]*\n|<!--\s*checked:.*?-->[ \t]*\n(?:[ \t]*\n)?", re.MULTILINE)
#: spans that hold no prose figures: fenced and inline code, comments, link targets, URLs, dates, times
_MASK = re.compile(r"```.*?```|`(?:[^`\n]|\n(?![ \t]*\n))*`|<!--.*?-->|(?:Python|≥|>=|==|<=)\s*\d+(?:\.\d+)+|\]\([^)\s]*\)|https?://\S+|\b\d{4}-\d{2}-\d{2}(?:T[\d:+]+)?"
                   r"|\b\d{1,2}:\d{2}(?::\d{2})?\b|arXiv \d{4}\.\d{4,5}", re.DOTALL)
_NUM = re.compile(r"(?<![\w.])(?<![A-Za-z][-–])[+-]?\d+(?:,\d{3})*(?:\.\d+)?")
_CODE = re.compile(r"```.*?```|`(?:[^`\n]|\n(?![ \t]*\n))*`", re.DOTALL)
#: a unit right after a number that makes it a figure (``12x``, ``96%``, ``0.43 s``, ``2.2 GB``)
_UNIT = re.compile(r"(?:x|×|%|\s?(?:s|ms|µs|GB|MB|GiB|MiB|KiB|ns|points?|pp)|\s?ms/step)(?![\w])")
#: letters right after a number that make it not a figure: sizes (0.5B, 135M, 2k), versions (v1.2), ids
_NOT_FIGURE_TAIL = re.compile(r"(?:\.\d|[A-Za-z_])")


class Setting:
    """What ``setting(n)`` gives for each of the last ``n`` numbers: a configured value (a preset's
    cut, an interval's level), not a measurement; sourced, not checked."""


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}


def code_constant(path: Path, name: str) -> Any:
    """The value a source file gives a constant, read without importing it: ``NAME`` (a module-level
    assignment), ``Class.NAME`` (a class body's, a dataclass field's default) or ``function.param``
    (a parameter's default). The value is a literal, or ``+ - * /`` of literals and the module's
    other constants (``EXIT_GRACE_S = DRAIN_GRACE_S + CLOSE_GRACE_S``); anything else is an error.
    A page states a configured value (a timeout, a default) with it, so the page follows the code."""
    tree = ast.parse(path.read_text("utf-8"))
    scopes: dict[str, dict[str, ast.expr]] = {"": {}}

    def assignments(body: list[ast.stmt], scope: dict[str, ast.expr]) -> None:
        for node in body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                scope[node.targets[0].id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                scope[node.target.id] = node.value

    assignments(tree.body, scopes[""])
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            assignments(node.body, scopes.setdefault(node.name, {}))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            defaults = dict(zip((a.arg for a in positional[len(positional) - len(args.defaults):]), args.defaults, strict=True))
            defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None}
            scopes.setdefault(node.name, {}).update(defaults)
    owner, _, attr = name.rpartition(".")
    if owner not in scopes or attr not in scopes[owner]:
        raise ConfigError(f"{path}: no constant {name!r}")

    def value(node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Name) and node.id in scopes[""]:
            return value(scopes[""][node.id])
        raise ConfigError(f"{path}: {name} is not a literal or arithmetic of the module's constants")

    return value(scopes[owner][attr])


def linear_weights_gb(shape: dict[str, int], bytes_per_value: int = 2) -> float:
    """GB (1e9 bytes) of a decoder's linear weights, from a result's recorded model ``shape``
    (``num_layers``, ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``intermediate_size``, ``vocab_size``): per layer the q, k, v, o, gate, up and down products, and
    the LM head; ``bytes_per_value`` 2 for bfloat16, 4 for float32. A size, not a measurement."""
    h, d = shape["hidden_size"], shape["head_dim"]
    attn = 2 * h * shape["num_heads"] * d + 2 * h * shape["num_kv_heads"] * d
    mlp = 3 * h * shape["intermediate_size"]
    return (shape["num_layers"] * (attn + mlp) + h * shape["vocab_size"]) * bytes_per_value / 1e9


def kv_cache_mb(shape: dict[str, int], tokens: float, bytes_per_value: int = 2) -> float:
    """MB (1e6 bytes) of the K/V of ``tokens`` positions, every layer, from a recorded model
    ``shape``; ``bytes_per_value`` 2 for bfloat16, 4 for float32. A size, not a measurement."""
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * tokens * bytes_per_value / 1e6


@dataclass(frozen=True)
class Figure:
    """A number in a page's prose: where it stands, its text, and whether it is a figure."""

    start: int
    end: int
    text: str
    figure: bool


def _masked(text: str) -> str:
    """``text`` with its non-prose spans, and the tables a ``from:`` comment checks, blanked
    (same length, so offsets hold)."""
    out = _MASK.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for match in _FROM.finditer(text):  # the table after a from: comment is checked cell by cell
        end = match.end()
        while end < len(out):
            nl = out.find("\n", end)
            line = out[end: nl if nl >= 0 else len(out)]
            if not line.lstrip().startswith("|"):
                break
            out = out[:end] + re.sub(r"[^\n]", " ", line) + out[end + len(line):]
            end += len(line) + 1
    return out


def figures(text: str, masked: str | None = None) -> list[Figure]:
    """Every number of ``text``'s prose, in order (see the module docstring for which are figures)."""
    masked = _masked(text) if masked is None else masked
    found = []
    for m in _NUM.finditer(masked):
        tail = masked[m.end(): m.end() + 12]
        if _NOT_FIGURE_TAIL.match(tail) and not _UNIT.match(tail):
            continue  # 0.5B, 2k, 2.13.0, bfloat16's 16 is already excluded by the look-behind
        figure = "." in m.group(0) or bool(_UNIT.match(tail))
        found.append(Figure(m.start(), m.end(), m.group(0), figure))
    return found


def sources(text: str) -> Iterator[tuple[int, int, str]]:
    """``(start, end, expression)`` of every ``<!-- src: ... -->`` comment of ``text``."""
    code = _CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # a comment quoted in code is no source
    for m in _SRC.finditer(code):
        yield m.start(), m.end(), text[m.start(1): m.end(1)]


# --------------------------------------------------------------------------- the helpers a source may use

_UNITS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


def _cpu_class(cpu: str) -> str:
    return "Xeon" if "Xeon" in cpu else "EPYC" if "EPYC" in cpu else cpu


def machine_of(header: dict[str, Any], dtype: str | None = None) -> str:
    """How a page names the machine class of a record: ``"Xeon, AMX-BF16, bfloat16"``,
    ``"EPYC, AVX2, float32"`` (CPU family, bfloat16 units, the dtype the run computed in).

    A record from before headers named them has no ``bf16_units`` and no ``dtype``: its units are
    ``bf16 units not recorded`` (the CPU name does not tell them: "AMD EPYC" names machines with
    and without bfloat16 units) and its dtype float32 (the only dtype before bfloat16 came); a
    record without a CPU name says ``CPU not recorded`` (one whose units are AMX-BF16 is a Xeon)."""
    cpu = _cpu_class(str(header.get("cpu") or "CPU not recorded"))
    units = header.get("bf16_units")
    if cpu == "CPU not recorded" and units == "amx_bf16":
        cpu = "Xeon"  # AMX is Intel's: of the project's machines, the Xeon
    if units is None and "bf16_native" in header:
        units = "amx_bf16" if header["bf16_native"] else "none"
    dtype = dtype or header.get("dtype") or header.get("model_dtype") or "float32"
    label = _UNITS.get(units, units or "bf16 units not recorded")
    if units == "none":  # no bfloat16 units: the vector ISA the header records, where it does
        label = header.get("cpu_isa") or "no bf16 units"
    return f"{cpu}, {label}, {dtype}"


def _header_of(results: Path, file: str) -> dict[str, Any]:
    """The header that names the machine of a result file (a ``.md`` table: its ``.json`` or
    ``.jsonl``; an anchors summary: fastprefill's run beside it)."""
    path = results / file
    if path.name == "summary.md" and "anchors" in path.parts:
        runs = sorted(path.parent.glob("run-fastprefill*.jsonl"))
        head = json.loads(runs[0].read_text().splitlines()[0])
        dtype = head.get("config", {}).get("model_dtype") or head.get("dtype")
        if "bf16_units" not in head and "--dtype" not in head.get("command", "") and dtype == "float32":
            head = {**head, "bf16_units": "none"}  # fastprefill's dtype auto picks float32 only without units
        return {**head, "dtype": dtype}
    if path.name.endswith("_budget.md"):
        path = path.with_name(path.name.removesuffix("_budget.md") + ".jsonl")
    if path.suffix == ".md":
        for suffix in (".json", ".jsonl"):
            if path.with_suffix(suffix).exists():
                path = path.with_suffix(suffix)
                break
    if path.suffix == ".json":
        d = json.loads(path.read_text())
        return {**d.get("environment", {}), **d.get("header", {}), **{k: v for k, v in d.items() if isinstance(v, str)}}
    first = json.loads(path.read_text().splitlines()[0])
    if "header" in first:
        return first["header"]
    return {**first, **first.get("machine", {})} if first.get("type") != "header" else first


def _number(cell: str) -> float:
    m = re.search(r"[+-]?\d+(?:\.\d+)?", cell.replace(",", ""))
    if not m:
        raise ConfigError(f"cell {cell!r} holds no number")
    return float(m.group(0))


def namespace(results: Path) -> dict[str, Any]:
    """The helpers a source expression may call, reading the result files under ``results``:

    - ``cell(file, column, **keys)``: the number in ``column`` of the one row whose key cells equal
      ``keys`` (``key_=`` for a key with spaces: ``where={"cached tokens": "2048"}``) in the tables
      that ``<!-- from: file -->`` would be checked against (the table recomputed from the records);
    - ``nums(file, column, **keys)``: every number of that cell (``[p25, p75]`` and the like);
    - ``header(file)``: the header of a ``.jsonl`` (``{"header": ...}`` or ``type: header`` line);
    - ``rows(file)``: its other lines; ``doc(file)``: a ``.json`` file;
    - ``machine(file, dtype=None)``: :func:`machine_of` the file's header;
    - ``speedup(file, method)`` and ``identical(file, method)``: ``cell`` of ``paired speedup`` and of
      ``identical answers``;
    - ``anchor(folder, length, kind, system, field="ratio", reference="fastprefill")``: a figure
      of an anchors run (``anchors/<folder>/run-*.jsonl``) as ``summarize.cell`` computes it,
      unrounded (``reference``: the system the paired ratios divide by);
    - ``checkpoint(name, file="train_meta.json")``: a JSON file of ``benchmarks/checkpoints/<name>/``;
    - ``weights_mb(name)``: the size of a checkpoint's committed ``.safetensors`` files, in MB;
    - ``budget(file)``: a mixed-load record's per-long-prompt budget (``serve_mixed_budget.budget``);
    - ``same(a, b, ...)``: one printed figure that stands for several values, all equal;
    - ``setting(n)``: the last ``n`` numbers are configured values (a preset's cut, a 95% interval's
      level), not measurements;
    - ``code(path, name)``: a configured value as the code gives it (:func:`code_constant`; ``path``
      from the checkout's root: ``code("src/fastprefill/serve/runner.py", "KEEP_ALIVE_S")``), checked
      like a measurement;
    - ``linear_weights_gb(shape, bytes_per_value=2)`` and ``kv_cache_mb(shape, tokens, bytes_per_value=2)``:
      sizes from a model shape a result records (``doc("roofline_....json")["shape"]``);
    - ``median``, ``mean``, ``min``, ``max``, ``len``, ``sum``, ``round``, ``abs``, ``sorted``.
    """
    from figures.pages import result_tables

    @cache
    def tables(file: str) -> list[list[dict[str, str]]]:
        return result_tables(results, file)

    def cell(file: str, column: str, where: dict[str, str] | None = None, **keys: Any) -> float:
        want = {**{k: str(v) for k, v in keys.items()}, **(where or {})}
        for table in tables(file):
            if not table or column not in table[0] or not set(want) <= set(table[0]):
                continue
            found = [r for r in table if all(r[k] == v for k, v in want.items())]
            if len(found) == 1:
                return _number(found[0][column])
            raise ConfigError(f"{file}: {len(found)} rows with {want} in the table with {column!r}")
        raise ConfigError(f"{file}: no recomputed table has the columns {column!r} and {sorted(want)}")

    @cache
    def _lines(file: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        path = results / file
        try:
            return read_rows(path)
        except ConfigError:
            items = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
            heads = [i for i in items if i.get("type") == "header"]
            return (heads[0] if heads else {}), [i for i in items if i.get("type") != "header"]

    def header(file: str) -> dict[str, Any]:
        return _lines(file)[0]

    def rows(file: str) -> list[dict[str, Any]]:
        return _lines(file)[1]

    def doc(file: str) -> Any:
        return json.loads((results / file).read_text())

    def machine(file: str, dtype: str | None = None) -> str:
        return machine_of(_header_of(results, file), dtype)

    def nums(file: str, column: str, where: dict[str, str] | None = None, **keys: Any) -> tuple[float, ...]:
        cell(file, column, where, **keys)  # the same lookup and errors
        want = {**{k: str(v) for k, v in keys.items()}, **(where or {})}
        for table in tables(file):
            if table and column in table[0] and set(want) <= set(table[0]):
                row = next(r for r in table if all(r[k] == v for k, v in want.items()))
                return tuple(float(x) for x in re.findall(r"[+-]?\d+(?:\.\d+)?", row[column].replace(",", "")))
        raise ConfigError(f"{file}: no {column!r}")

    def speedup(file: str, method: str, **keys: Any) -> float:
        return cell(file, "paired speedup", method=method, **keys)

    def identical(file: str, method: str, **keys: Any) -> float:
        return cell(file, "identical answers", method=method, **keys)

    def anchor(folder: str, length: int, kind: str, system: str, field: str = "ratio",
               reference: str = "fastprefill") -> Any:
        from figures.families import anchors_summarize

        summarize = anchors_summarize()
        headers, runs = summarize.load(sorted(str(p) for p in (results / "anchors" / folder).glob("run-*.jsonl")))
        model = headers[0]["model"]
        value = summarize.cell(runs, model, length, kind, system, summarize.other_sittings(headers), reference)[field]
        if value is None:
            raise ConfigError(f"anchors/{folder}: no {field} for {system} {kind} at {length} (not paired)")
        return value

    def checkpoint(name: str, file: str = "train_meta.json") -> Any:
        return json.loads((results.parent / "checkpoints" / name / file).read_text())

    def weights_mb(name: str) -> float:
        return sum(f.stat().st_size for f in (results.parent / "checkpoints" / name).glob("*.safetensors")) / 1e6

    def budget(file: str) -> list[dict[str, Any]]:
        from serve_mixed_budget import budget as rows_of

        head, body = read_rows(results / file)
        return rows_of(head, body)

    def same(*values: Any) -> Any:
        if len(set(values)) != 1:
            raise ConfigError(f"one figure stands for several values that differ: {values}")
        return values[0]

    def setting(n: int = 1) -> tuple[Setting, ...]:
        return (Setting(),) * n

    def code(path: str, name: str) -> Any:
        return code_constant(results.resolve().parent.parent / path, name)  # a checkout linking its benchmarks/ reads the code beside them

    return {"cell": cell, "nums": nums, "setting": setting, "code": code, "linear_weights_gb": linear_weights_gb,
            "kv_cache_mb": kv_cache_mb, "same": same, "speedup": speedup, "identical": identical,
            "anchor": anchor, "budget": budget, "checkpoint": checkpoint, "weights_mb": weights_mb, "header": header, "rows": rows, "doc": doc, "machine": machine,
            "median": statistics.median, "mean": statistics.mean, "min": min, "max": max, "len": len, "sum": sum,
            "round": round, "abs": abs, "sorted": sorted, "tuple": tuple, "list": list, "any": any, "all": all, "zip": zip, "next": next, "str": str, "int": int, "float": float,
            "__builtins__": {}}


# --------------------------------------------------------------------------- the check


def _paragraph_start(text: str, at: int) -> int:
    cut = text.rfind("\n\n", 0, at)
    return 0 if cut < 0 else cut + 2


def check_prose(page: str, text: str, results: Path, ns: dict[str, Any] | None = None) -> tuple[list[Mismatch], set[int]]:
    """Evaluate every source comment of ``text`` and compare the numbers (or label) it sources;
    also give the offsets of the numbers sourced."""
    ns = dict(namespace(results) if ns is None else ns)
    out: list[Mismatch] = []
    for m in _LET.finditer(_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)):
        for item in filter(None, (x.strip() for x in m.group(1).split(";"))):
            name, _, expr = item.partition("=")
            try:
                ns[name.strip()] = eval(expr, ns)
            except Exception as exc:  # noqa: BLE001
                out.append(Mismatch(page, f"let {name.strip()}", expr.strip(), f"{type(exc).__name__}: {exc}"))
    masked = _masked(text)
    numbers = figures(text, masked)
    claimed: set[int] = set()
    previous = 0
    for start, end, expr in sources(text):
        window = max(previous, _paragraph_start(text, start))
        previous = end
        line = text.count("\n", 0, start) + 1
        where = f"line {line}: src {expr[:80]}"
        try:
            value = eval(expr, ns)
        except Exception as exc:  # noqa: BLE001 - any failure is a mismatch to report
            out.append(Mismatch(page, where, "(a source)", f"{type(exc).__name__}: {exc}"))
            continue
        if isinstance(value, str):
            before = re.sub(r"[\s*_)\]]+$", "", text[window:start])
            if not before.endswith(value) and not _short_label(before[-80:], value):
                out.append(Mismatch(page, where, before[-len(value) - 10:], value))
            continue
        values = list(value) if isinstance(value, (tuple, list)) else [value]
        mine = [f for f in numbers if window <= f.start and f.end <= start]
        if len(mine) < len(values):
            out.append(Mismatch(page, where, [f.text for f in mine], f"{len(values)} values"))
            continue
        for fig, val in zip(mine[len(mine) - len(values):], values, strict=True):
            claimed.add(fig.start)
            printed = fig.text.lstrip("+").replace(",", "")
            if isinstance(val, Setting):
                continue
            if not isinstance(val, (int, float)) or not cell_matches(printed, _format(val, printed)):
                out.append(Mismatch(page, where, fig.text, val))
    return out, claimed


def _short_label(before: str, label: str) -> bool:
    """A label written short (``on the EPYC in float32``): the text just before the comment names
    the label's CPU family and its dtype, and no other family."""
    parts = [p.strip() for p in label.split(",")]
    if len(parts) != 3:
        return False
    cpu, _, dtype = parts
    others = {"Xeon", "EPYC"} - {cpu}
    return cpu in before and dtype in before and not any(o in before for o in others)


def _format(value: float, printed: str) -> str:
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:.{decimals + 3}f}"


def unsourced(text: str, results: Path | None = None, claimed: set[int] | None = None) -> list[str]:
    """The figures of ``text`` that no source comment sources, each with its line and context."""
    if claimed is None:
        claimed = _claims(text)
    out = []
    for f in figures(text):
        if f.figure and f.start not in claimed:
            line = text.count("\n", 0, f.start) + 1
            lo = text.rfind("\n", 0, f.start) + 1
            context = text[max(lo, f.start - 30): f.end + 12].replace("\n", " ")
            out.append(f"{line}: {f.text} ({context.strip()})")
    return out


def _claims(text: str) -> set[int]:
    """The offsets of the numbers the source comments claim, without evaluating them: the last
    ``N`` before each comment, ``N`` the comment's number of values (a tuple's items, else 1; 0 for
    a label)."""
    numbers = figures(text)
    claimed: set[int] = set()
    previous = 0
    for start, end, expr in sources(text):
        window = max(previous, _paragraph_start(text, start))
        previous = end
        n = _arity(expr)
        mine = [f for f in numbers if window <= f.start and f.end <= start]
        claimed |= {f.start for f in mine[len(mine) - n:]} if n else set()
    return claimed


def _arity(expr: str) -> int:
    import ast

    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return 0
    if isinstance(node, ast.Tuple):
        return len(node.elts)
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "machine":
        return 0
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setting":
        return int(node.args[0].value) if node.args and isinstance(node.args[0], ast.Constant) else 1
    return 1
