#!/usr/bin/env bash
# Run 3 of the GPU check (2026-12-04, second session): the parts runs 1-2 did not reach. One device call, ~10 min.
#   bash benchmarks/results/gpu_check/h200_2026-12-04_run3/run.sh OUT
# 1. the CUDA tests; 2. compiled FlexAttention's parity for every scheme but FIRE (it did not finish compiling in
# run 2) and CoPE (never on FlexAttention), fp32, then bf16 for six; 3. FlexAttention timings at 1024 and 4096.
set -u
out=${1:?OUT folder}
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/machine.txt" 2>&1
quiet() { grep -v -e DEBUG -e '^V[0-9]' ; }
timeout 60 python3 -m pytest -q -p no:logging -m gpu tests/test_attention_flex.py --tb=line 2>&1 | tail -15 > "$out/pytest.log"
mkdir -p "$out/fp32" "$out/bf16" "$out/timing"
timeout 200 python3 benchmarks/gpu_check.py --out "$out/fp32" --skip-ddp --skip-timing --backends flex --dtypes fp32 \
  --schemes xl_abcd,xl_b,xl_d,xl_ac,bias_xl_table,bias_t5,bias_alibi,bias_alibi_learned,bias_kerple_log,bias_kerple_power,bias_dynamic,bias_sandwich,rope,rope_xpos,fox,window_sinks_fox,log_n_temperature \
  2>&1 | quiet > "$out/fp32.log"
timeout 75 python3 benchmarks/gpu_check.py --out "$out/bf16" --skip-ddp --skip-timing --backends flex --dtypes bf16 \
  --schemes xl_abcd,bias_t5,bias_alibi,fox,rope,window_sinks_fox 2>&1 | quiet > "$out/bf16.log"
timeout 200 python3 benchmarks/gpu_check.py --out "$out/timing" --skip-parity --skip-ddp --lengths 1024,4096 \
  --timed xl_abcd,t5,alibi,fox,rope,kerple_log,sandwich --deadline 150 --pairs 3 2>&1 | quiet > "$out/timing.log"
echo done >> "$out/machine.txt"
