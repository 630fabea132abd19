#!/usr/bin/env bash
# The whole anchor measurement of one model, in rounds: the prompt set, then ROUNDS rounds in
# each of which every system runs once (each in its own venv and process, nothing else running)
# on the same prompts, then the summary table of per-round paired ratios.
#
#   bash benchmarks/anchors/run_all.sh MODEL [OUTDIR]
#
# MODEL: smollm2-135m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b (prepared; setup.sh done for it).
# OUTDIR: default benchmarks/anchors/results/MODEL. Writes prompts.jsonl, run-<system>-round<r>.jsonl,
# run-<system>-round<r>.log and summary.md there.
# Environment: ROUNDS (5), THREADS (2), REPEATS (1: runs of each pair per system per round),
# LENGTHS ("2048 4096"), PAIRS (3), DECODE (32: decode steps timed after each hit; 0 none),
# SYSTEMS ("fastprefill vllm openvino llamacpp"; fastprefill_<row> is fastprefill's runner again,
# its rows named so, e.g. FASTPREFILL_LAZYLLM_ARGS="--method lazyllm:..." for fastprefill_lazyllm),
# <SYSTEM>_ARGS (more arguments for one system's runner, e.g. VLLM_ARGS="--dtype float32" on a
# CPU without bfloat16 units). Round r starts with the system at position r of SYSTEMS (the order
# rotates, so no system always runs first or last). A system that fails is reported and skipped.
# PERSISTENT=1: each system's process stays up across the rounds (rounds.py): it loads and warms
# up once, then runs the timed pairs once per round; its console output goes to run-<system>.log.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENVS="${ANCHORS_VENVS:-$REPO/.venv-anchors}"
FP_PY="${FASTPREFILL_PYTHON:-$REPO/.venv/bin/python}"
CACHE="${FASTPREFILL_CACHE_DIR:-$HOME/.cache/fastprefill}"
MODEL="${1:?usage: run_all.sh MODEL [OUTDIR]}"
OUT="${2:-$HERE/results/$MODEL}"
ROUNDS="${ROUNDS:-5}" THREADS="${THREADS:-2}" REPEATS="${REPEATS:-1}" DECODE="${DECODE:-32}" LENGTHS="${LENGTHS:-2048 4096}" PAIRS="${PAIRS:-3}"
SYSTEMS="${SYSTEMS:-fastprefill vllm openvino llamacpp}"
mkdir -p "$OUT"

if [[ ! -f "$OUT/prompts.jsonl" ]]; then
  # shellcheck disable=SC2086
  "$FP_PY" "$HERE/prompts.py" --model "$MODEL" --lengths $LENGTHS --pairs "$PAIRS" --out "$OUT/prompts.jsonl" || exit 1
fi

read -r -a order <<< "$SYSTEMS"
status=0
# the runner command of one system (without --out), for either way of running the rounds
command_of() {
  local system="$1" runner="${1%%_*}" py extra
  case "$runner" in
    fastprefill) py="$FP_PY" ;;
    *) py="$VENVS/$runner/bin/python" ;;
  esac
  extra="${system^^}_ARGS"
  printf '%q ' "$py" "$HERE/${runner}_run.py" --model-dir "$CACHE/models/$MODEL" --prompts "$OUT/prompts.jsonl" \
    --threads "$THREADS" --repeats "$REPEATS" --decode-tokens "$DECODE"
  [[ "$runner" != "$system" ]] && printf '%q ' --name "$system"
  printf '%s' "${!extra:-}"  # word-split by eval, as the command line would be
}
summarize() {  # the table over every round's files, where any run was written
  if compgen -G "$OUT/run-*-round*.jsonl" > /dev/null; then
    python3 "$HERE/summarize.py" "$OUT"/run-*-round*.jsonl --out "$OUT/summary.md"
  else
    echo "no runs were written: no summary" >&2
  fi
}
if [[ "${PERSISTENT:-0}" == 1 ]]; then
  args=()
  for system in "${order[@]}"; do args+=(--system "$system" "$(command_of "$system")"); done
  python3 "$HERE/rounds.py" --out "$OUT" --rounds "$ROUNDS" "${args[@]}" || status=1  # each command split there by shlex
  summarize
  exit $status
fi
for ((round = 0; round < ROUNDS; round++)); do
  for ((i = 0; i < ${#order[@]}; i++)); do
    system="${order[$(( (i + round) % ${#order[@]} ))]}"
    run="$OUT/run-$system-round$round"
    echo "== round $round/$ROUNDS: $system" >&2
    if ! eval "$(command_of "$system") --out $(printf %q "$run.jsonl")" > "$run.log" 2>&1; then
      echo "$system FAILED in round $round: see $run.log" >&2
      rm -f "$run.jsonl"  # a partial file would pair only some prompts of this round
      status=1
    fi
  done
done
summarize
exit $status
