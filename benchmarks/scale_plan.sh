#!/usr/bin/env bash
# Regenerate the rows of docs/scaling.md's scale plan: one `jaxgpt aot` compile per row, printed report and
# JSON per row in OUT_DIR (default runs/scale_plan), with the wall time of each command. Headline rows first.
#   bash benchmarks/scale_plan.sh [OUT_DIR] [FIRST_ROW] [LAST_ROW]
# Needs libtpu (pip install -e ".[tpu]"); each GPT-2-sized row takes minutes on a 2-core machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/scale_plan}
first=${2:-1}
last=${3:-99}
mkdir -p "$out"
rows=(
  "configs/gpt2_124m.py v5e:2x2 --config.batch_size=64 --config.grad_accum=1"
  "configs/gpt2_124m.py v5e:2x2 --config.batch_size=4 --config.grad_accum=1 --config.model.block_size=8192"
  "configs/gpt2_124m.py v5e:2x2 --config.batch_size=32 --config.grad_accum=1"
  "configs/gpt2_124m.py v5e:2x2 --config.batch_size=32 --config.grad_accum=1 --config.model.remat=full"
  "configs/gpt2_124m.py v5e:4x4 --config.grad_accum=1 --config.model.remat=full"
  "configs/gpt2_medium.py v5e:4x4"
  "configs/gpt2_large.py v5e:8x8"
  "configs/gpt2_xl.py v5p:4x4x4"
  "configs/gpt2_xl.py v5p:4x4x4 --config.model.remat=save_dots"
  "configs/gpt2_xl.py v5p:4x4x4 --config.model.remat=none"
  "configs/gpt2_xl.py v5e:8x8"
  "configs/gpt2_xl.py v5p:2x2x2 --config.grad_accum=8"
  "configs/gpt2_xl.py v5e:2x2 --config.model.remat=none --config.batch_size=64"
  "configs/gpt_6.7b.py v5p:4x4x8"
  "configs/gpt_6.7b.py v5p:4x4x8 --config.mesh.fsdp=32 --config.mesh.tensor=4"
  "configs/gpt_6.7b.py v5e:16x16"
  "configs/gpt_6.7b.py v6e:16x16"
  "configs/gpt_6.7b.py v4:4x4x8"
  "configs/gpt_6.7b.py v5e:4x4"
)
for i in "${!rows[@]}"; do
  n=$((i + 1))
  if (( n < first || n > last )); then continue; fi
  read -r config topology overrides <<< "${rows[$i]}"
  name=$(printf "%02d" "$n")
  echo "\$ jaxgpt aot --config $config --topology $topology $overrides" > "$out/$name.txt"
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m jaxgpt aot --config "$config" --topology "$topology" $overrides --json "$out/$name.json" \
    >> "$out/$name.txt" 2> "$out/$name.err"
  echo "(the whole command took $(( $(date +%s) - start )) s)" >> "$out/$name.txt"
  cat "$out/$name.txt"
done
