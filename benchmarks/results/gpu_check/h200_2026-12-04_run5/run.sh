#!/usr/bin/env bash
# Run 5 of the GPU check (2026-12-04, second session): FIRE on compiled FlexAttention from its piecewise-linear
# tables (run 4: inductor cannot differentiate the unit-by-unit MLP's weights, read once per unit). One device call.
#   bash benchmarks/results/gpu_check/h200_2026-12-04_run5/run.sh OUT
set -u
out=${1:?OUT folder}
export PYTHONPATH=.
quiet() { grep -v -e DEBUG -e '^V[0-9]' ; }
timeout 75 python3 -m pytest -q -p no:logging -m gpu tests/test_attention_flex.py -k "fire or abcd" -rA --tb=short \
  2>&1 | quiet | grep -v -e '^    ' | tail -60 > "$out/pytest.log"
mkdir -p "$out/parity"
timeout 80 python3 benchmarks/gpu_check.py --out "$out/parity" --skip-ddp --skip-timing --backends flex --dtypes fp32 \
  --schemes bias_fire 2>&1 | quiet > "$out/parity.log"
echo done > "$out/done.txt"
