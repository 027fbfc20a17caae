#!/usr/bin/env bash
# Run 4 of the GPU check (2026-12-04, second session): FoX on compiled FlexAttention after reading Λ from two
# tensors (run 3: inductor cannot differentiate two reads of one tensor in a score_mod). One device call.
#   bash benchmarks/results/gpu_check/h200_2026-12-04_run4/run.sh OUT
set -u
out=${1:?OUT folder}
export PYTHONPATH=.
quiet() { grep -v -e DEBUG -e '^V[0-9]' ; }
timeout 120 python3 -m pytest -q -p no:logging -m gpu tests/test_attention_flex.py -rA --tb=line 2>&1 | quiet | tail -25 > "$out/pytest.log"
mkdir -p "$out/parity" "$out/timing"
timeout 100 python3 benchmarks/gpu_check.py --out "$out/parity" --skip-ddp --skip-timing --backends flex \
  --schemes fox,window_sinks_fox 2>&1 | quiet > "$out/parity.log"
timeout 110 python3 benchmarks/gpu_check.py --out "$out/timing" --skip-parity --skip-ddp --lengths 1024,4096 \
  --timed fox,alibi --deadline 90 --pairs 5 2>&1 | quiet > "$out/timing.log"
echo done > "$out/done.txt"
