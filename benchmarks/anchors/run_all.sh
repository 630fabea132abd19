#!/usr/bin/env bash
# The whole anchor measurement of one model: the prompt set, then each system in turn (one at a
# time, nothing else running), then the summary table.
#
#   bash benchmarks/anchors/run_all.sh MODEL [OUTDIR]
#
# MODEL: smollm2-135m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b (prepared; setup.sh done for it).
# OUTDIR: default benchmarks/anchors/results/MODEL. Writes prompts.jsonl, run-<system>.jsonl,
# run-<system>.log and summary.md there.
# Environment: THREADS (2), REPEATS (3), LENGTHS ("2048 4096"), PAIRS (3),
# SYSTEMS ("fastprefill vllm openvino llamacpp"), <SYSTEM>_ARGS (more arguments for one system's
# runner, e.g. VLLM_ARGS="--dtype float32" on a CPU without bfloat16 units). A system that fails
# is reported and skipped.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENVS="${ANCHORS_VENVS:-$REPO/.venv-anchors}"
FP_PY="${FASTPREFILL_PYTHON:-$REPO/.venv/bin/python}"
CACHE="${FASTPREFILL_CACHE_DIR:-$HOME/.cache/fastprefill}"
MODEL="${1:?usage: run_all.sh MODEL [OUTDIR]}"
OUT="${2:-$HERE/results/$MODEL}"
THREADS="${THREADS:-2}" REPEATS="${REPEATS:-3}" LENGTHS="${LENGTHS:-2048 4096}" PAIRS="${PAIRS:-3}"
SYSTEMS="${SYSTEMS:-fastprefill vllm openvino llamacpp}"
mkdir -p "$OUT"

if [[ ! -f "$OUT/prompts.jsonl" ]]; then
  # shellcheck disable=SC2086
  "$FP_PY" "$HERE/prompts.py" --model "$MODEL" --lengths $LENGTHS --pairs "$PAIRS" --out "$OUT/prompts.jsonl" || exit 1
fi

status=0
for system in $SYSTEMS; do
  case "$system" in
    fastprefill) py="$FP_PY" ;;
    *) py="$VENVS/$system/bin/python" ;;
  esac
  extra="${system^^}_ARGS"
  echo "== $system ${!extra:-}" >&2
  # shellcheck disable=SC2086
  if ! "$py" "$HERE/${system}_run.py" --model-dir "$CACHE/models/$MODEL" --prompts "$OUT/prompts.jsonl" \
      --threads "$THREADS" --repeats "$REPEATS" --out "$OUT/run-$system.jsonl" ${!extra:-} > "$OUT/run-$system.log" 2>&1; then
    echo "$system FAILED: see $OUT/run-$system.log" >&2
    status=1
  fi
done
python3 "$HERE/summarize.py" "$OUT"/run-*.jsonl --out "$OUT/summary.md"
exit $status
