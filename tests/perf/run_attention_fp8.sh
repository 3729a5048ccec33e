#!/usr/bin/env bash
# One device call (nvidia-h200) for issue 12's attention backends and FP8 layers:
#   bash tests/perf/run_attention_fp8.sh [tests|bench|train ...]   (default: all three)
# GPU tests (attention backends, FP8 linear, RoPE), the attention and FP8-linear benchmarks, and
# bench_train (mpcore only) at seq 4096 x 4 with flash, auto and auto + FP8. JSON and one log go
# to $OUT (the device tool brings them back) or tests/perf/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-tests/perf/results}
log="$out/run_attention_fp8.log"
export PYTHONUNBUFFERED=1
parts=${*:-tests bench train}
step() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  echo "   exit $?" | tee -a "$log"
}
for part in $parts; do
  case $part in
    tests)
      step gpu_tests 170 python3 -m pytest -q -rs -s tests/gpu/test_attention_backends_gpu.py \
        tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_rope_kernel_gpu.py
      grep -E "passed|failed|^FAILED|^E  |fp8 vs|one rounding|loss bf16" "$log" | tail -25 ;;
    bench)
      step bench_attention 100 python3 -m tests.perf.bench_attention "$out/attention_h200.json"
      step bench_fp8_linear 60 python3 -m tests.perf.bench_fp8_linear "$out/fp8_linear_h200.json"
      grep -A12 "^case " "$log" | head -12; grep -E " x[0-9.]+$" "$log" | tail -4 ;;
    train)
      for v in "flash none" "auto none" "auto tensorwise"; do
        set -- $v
        step "train_$1_$2" 100 python3 -m tests.perf.bench_train "$out/train_$1_$2.json" \
          --skip-hf --steps 8 --warmup 3 --attention-backend "$1" --fp8 "$2"
        grep -E '"(step_ms|tokens_per_s_per_gpu|peak_gib|first_loss|last_loss)"' \
          "$out/train_$1_$2.json" 2>/dev/null | tr -d '\n '; echo
      done ;;
  esac
done
