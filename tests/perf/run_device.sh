#!/usr/bin/env bash
# One device call for the benchmarks that still need numbers (see tests/perf/NOTES.md).
#   bash tests/perf/run_device.sh tests    # tests/gpu (on either kind; run it first)
#   bash tests/perf/run_device.sh          # on nvidia-h200:    model + train vs transformers
#   bash tests/perf/run_device.sh x2       # on nvidia-h200-x2: training at tp=2, cp=2, dp=2
#   bash tests/perf/run_device.sh te | te_bench | te_train | te2   # with TransformerEngine (TE.md)
#   bash tests/perf/run_device.sh peers [4096x4|16384x1] [ROWS]   # TE + peer wheels (--all)
#   bash tests/perf/run_device.sh moe [HF_EXPERTS]   # Qwen3-MoE step; + Megatron-core with TE
#   bash tests/perf/run_device.sh loss_peers          # loss heads with verl's RL head (no TE)
#   bash tests/perf/run_device.sh vl                  # VL GPU tests, then the three VL families
#   bash tests/perf/run_device.sh qwen35 check|tests|tests32 'FAMILY...'|gates [CASES]|score|bench|bench32|rest|diag [SIDE]|vlsplit|vlcheck|moe [SEQ]|peers   # issues 36, 37 (Triton 3.7.1 first)
# Carry the liger-kernel wheel (.whl) for its baseline. JSON and logs
# go to $OUT (the device tool brings them back) or tests/perf/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-tests/perf/results}
export PYTHONUNBUFFERED=1
# mpcore.kernels, mpcore.models, ... are the top-level folders mapped by pyproject.toml: the
# checkout must be installed (editable, no dependencies: the machine has no registry access).
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  || { echo "pip install -e . failed: mpcore.* would not import"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "   exit $? ($(grep -cE 'Error|error' "$out/$name.log") error lines)"
  grep -E '"tokens_per_s_per_gpu"|"peak_gib"|speedup|memory_ratio' "$out/$name.log" | head -8
}
if [ "${1:-}" = tests ]; then
  # Run this first: kernels written since the last GPU run (swiglu, rope, the flash single-call
  # path) have only run in Triton's CPU interpreter and on the CPU reference.
  run gpu_tests 540 python3 -m pytest -q tests/gpu
  tail -5 "$out/gpu_tests.log"
elif [ "${1:-}" = te ]; then
  # After TransformerEngine is installed on this machine (TE on PYTHONPATH); carry .whl.
  # New GPU tests first, then the TE FP8 step's profile, the attention backends (TE's fused
  # attention beside flash and cuDNN) and the loss heads. te_train: the 4096 x 4 rows side by
  # side in one run (native and TE, bf16 and FP8, beside one run of transformers and liger).
  run gpu_tests 300 python3 -m pytest -q tests/gpu/test_master_linear_gpu.py \
    tests/gpu/test_te_gpu.py tests/gpu/test_linear_cross_entropy_gpu.py tests/gpu/test_models_gpu.py \
    tests/gpu/test_attention_backends_gpu.py
  tail -4 "$out/gpu_tests.log"
  grep -E "rel err|PASS|FAIL" "$out/gpu_tests.log" | head -20
  run profile 200 python3 -m tests.perf.profile_train "$out/profile_train_h200_te_delayed.txt" \
    --linear-backend te --fp8 te_delayed
  tail -12 "$out/profile_train_h200_te_delayed.txt"
elif [ "${1:-}" = te_bench ]; then
  # TE's fused attention beside flash and cuDNN; the loss heads; the host time per step of
  # each linear backend (seq 512 x 1: the device work is small, the step is host-bound).
  run attention 200 python3 -m tests.perf.bench_attention "$out/attention_h200.json"
  tail -6 "$out/attention.log"
  run loss 240 python3 -m tests.perf.bench_loss "$out/loss_h200.json"
  tail -6 "$out/loss.log"
  run host 150 python3 -m tests.perf.bench_train "$out/train_h200_host_bound.json" --seq 512 \
    --micro-batch 1 --skip-hf --steps 20 --warmup 5 \
    --variants native:none,te:none,te:te_delayed,te:te_delayed:bf16_wgrad
  grep -E '"(fp8|step_ms|te_weight_grad)"' "$out/host.log" | head -20
elif [ "${1:-}" = te_train ]; then
  run train 580 python3 -m tests.perf.bench_train "$out/train_h200.json" \
    --variants native:none,te:none,te:te_delayed,te:te_delayed:bf16_wgrad,te:te_current,native:tensorwise
  grep -E '"(fp8|linear_backend|step_ms|speedup_vs_best_baseline|te_weight_grad)"' "$out/train.log" | head -40
elif [ "${1:-}" = te2 ]; then
  # Same machine, after `te`: seq 16k rows, the FP8 vs bf16 300-step curve (with the TE bf16
  # control run), the bf16 step's profile.
  run train16k 300 python3 -m tests.perf.bench_train "$out/train_h200_seq16k.json" --seq 16384 \
    --micro-batch 1 --variants native:none,te:te_delayed
  grep -E '"(fp8|step_ms|speedup_vs_best_baseline)"' "$out/train16k.log" | head -20
  run curve 480 python3 -m tests.perf.fp8_curve "$out/fp8_curve_h200.json"
  tail -30 "$out/curve.log"
elif [ "${1:-}" = peers ]; then
  # Megatron-core + TE and torchtitan (+ torchao float8) beside our rows (bf16 and TE FP8, each
  # with the fp32 and the bf16 residual stream), one shape per call; a third argument picks rows
  # (comma-separated) when the eight do not fit in one call. The rows' files come back as one
  # tar (a call brings back at most 8 files): `tar -xf peers_h200_SHAPE.tar` in results/.
  # Our rows' optimizer: OPTIMIZER_BACKEND (default triton, TritonAdamW).
  shape=${2:-4096x4}
  rows=${3:-megatron_bf16,megatron_fp8,torchtitan_bf16,torchtitan_float8,mpcore_bf16,mpcore_te_fp8,mpcore_bf16_res,mpcore_te_fp8_res}
  run peers 560 python3 -m tests.perf.bench_peers --out "/tmp/peers_h200_$shape" \
    --shapes "$shape" --rows "$rows" --steps 10 --warmup 3 --timeout 240 \
    --optimizer-backend "${OPTIMIZER_BACKEND:-triton}"
  tar -C /tmp -cf "$out/peers_h200_$shape.tar" "peers_h200_$shape"
  tail -16 "$out/peers.log"
elif [ "${1:-}" = moe ]; then
  # bench_moe.py: Qwen3-30B-A3B cut to 6 layers, seq 4096, mpcore vs transformers' experts
  # implementations (HF_EXPERTS, comma-separated) and, when TransformerEngine and megatron-core
  # import, Megatron-core's MoE (TE grouped GEMM, alltoall, ep=1) in its own process, first.
  # With TE: carry [".te/p6", ".whl"], `bash .te/p6/te-device-install && export
  # PYTHONPATH=/tmp/te-site:$PYTHONPATH && bash tests/perf/run_device.sh moe`.
  meg=()
  if python3 -W ignore -c "import transformer_engine.pytorch, megatron.core" >/dev/null 2>&1; then
    meg=(--megatron --megatron-timeout 240)
  else
    echo "   no Megatron row: transformer_engine.pytorch or megatron.core does not import"
  fi
  run moe 560 python3 -m tests.perf.bench_moe "$out/moe_h200.json" \
    --hf-experts "${2:-grouped_mm,batched_mm,eager}" ${meg[@]+"${meg[@]}"}
  grep -E '"(step_s|tokens_per_s|peak_gib|params|hf_fastest|speedup|speedup_vs_megatron|error|skipped)"' \
    "$out/moe.log" | head -30
elif [ "${1:-}" = loss_peers ]; then
  # bench_loss.py with verl's fused RL head beside ours (carry .whl: verl, liger, CCE; no TE on
  # the path, since liger's peft import would load it after torch's cuDNN). Exit 1 = verl's
  # outputs differ from ours at a shape (then that row has no time).
  run loss_peers 420 python3 -m tests.perf.bench_loss "$out/loss_peers_h200.json"
  grep -E "RL head|verl|FAIL|^[0-9]+ x" "$out/loss_peers.log" | tail -16
elif [ "${1:-}" = x2 ]; then
  two=(torchrun --nproc-per-node 2 -m tests.perf.bench_train)
  run train_tp2 240 "${two[@]}" "$out/train_h200x2_tp2.json" --tp 2 --steps 10 --warmup 3
  run train_cp2_ring 240 "${two[@]}" "$out/train_h200x2_cp2_ring.json" --cp 2 --cp-mode ring \
    --steps 10 --warmup 3
  run train_cp2_ulysses 240 "${two[@]}" "$out/train_h200x2_cp2_ulysses.json" --cp 2 \
    --cp-mode ulysses --steps 10 --warmup 3
  run train_dp2_fsdp 240 "${two[@]}" "$out/train_h200x2_dp2_fsdp.json" --steps 10 --warmup 3
  # The VL tower under cp=2: split over the ranks by patch count vs replicated on each; keep the
  # faster as model.vision_cp's default (issue 10 asks for this measurement).
  vl2=(torchrun --nproc-per-node 2 -m tests.perf.bench_vl)
  run vl_cp2_split 240 "${vl2[@]}" "$out/vl_h200x2_cp2_split.json" --cp 2 --vision-cp split
  run vl_cp2_replicate 240 "${vl2[@]}" "$out/vl_h200x2_cp2_replicate.json" --cp 2 \
    --vision-cp replicate
elif [ "${1:-}" = vl ]; then
  # bash tests/perf/run_device.sh vl   (nvidia-h200; carry .whl for the liger-kernel side):
  # the GPU tests of the VL path's kernels and models first (a failing kernel would make the
  # numbers meaningless), then the three families' 2B steps on real images, mpcore vs
  # transformers (+ liger); about 6 minutes in all.
  run gpu_tests_vl 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_layer_norm_gpu.py \
    tests/gpu/test_quick_gelu_gpu.py tests/gpu/test_rmsnorm_gpu.py tests/gpu/test_vl_gpu.py \
    tests/gpu/test_qwen3_vl_gpu.py tests/gpu/test_vision_gpu.py tests/gpu/test_models_gpu.py
  tail -3 "$out/gpu_tests_vl.log"
  run vl 200 python3 -m tests.perf.bench_vl "$out/vl_h200.json"
  run vl_qwen3 200 python3 -m tests.perf.bench_vl "$out/vl_qwen3_h200.json" --family qwen3_vl
  run vl_glm4v 240 python3 -m tests.perf.bench_vl "$out/vl_glm4v_h200.json" --family glm4v
  for name in vl vl_qwen3 vl_glm4v; do tail -3 "$out/$name.log"; done
elif [ "${1:-}" = qwen35 ]; then
  # Issue 36 (and 37's MTP benchmark) on one H100 or H200, after the four-part Triton 3.7.1 +
  # fla install of ../shared/notes/GPU.md (the last part call: `bash
  # /tmp/tri-parts/triton-device-install && export PYTHONPATH=/tmp/tri-site:$PWD && bash
  # tests/perf/run_device.sh qwen35 check`), then `bench` and `bench32` in the next calls of the
  # same warm machine (fla's Triton compile and autotuning, minutes when cold, stay cached
  # there). Each part fits one 600 s call. Files are named after the card (h100 or h200).
  python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, \
    'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', \
    fla.__version__)" 2>&1 | tail -1
  card=h200
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && card=h100
  bench32k() {  # seconds: the Qwen3.5-0.8B text step at 32768, both sides
    run bench_qwen35_32k "$1" python3 -m tests.perf.bench_qwen35 \
      "$out/qwen35_${card}_seq32k.json" --seq 32768 --steps 5 --warmup 2 --skip-layer
    tail -c 1500 "$out/bench_qwen35_32k.log"
  }
  moe_cut() {  # seconds, seq: the Qwen3.5-MoE cut against transformers' grouped_mm experts,
    # under expandable segments unless PYTORCH_CUDA_ALLOC_CONF says otherwise (`moe` says why)
    local seq=$2 tag=""; [ "$seq" = 4096 ] || tag="_seq$seq"
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      run bench_moe_qwen35 "$1" python3 -m tests.perf.bench_moe \
      "$out/moe_qwen3_5_$card$tag.json" --family qwen3_5_moe --seq "$seq" --steps 5 \
      --warmup 2 --hf-experts grouped_mm
    tail -c 2000 "$out/bench_moe_qwen35.log"
  }
  bring_triton_cache() {
    # Triton's cache (fla's compiled kernels and autotuning results) for a later machine:
    # carried back, it spares that machine the cold compile. At most 60 MB comes back beside
    # the JSON of one call (at 8406033 it was 68 MB and its last piece was left out), so the
    # pieces past 60 MB wait in /tmp/tcache_rest for bring_cache_rest in the next call.
    # A later machine: carry the pieces, `cat tcache* | tar -C ~/.triton -xzf -`.
    tar -C "$HOME/.triton" -czf /tmp/triton_cache.tgz cache 2>/dev/null \
      && ls -l /tmp/triton_cache.tgz
    rm -rf /tmp/tcache_rest && mkdir -p /tmp/tcache_rest
    split -b 15M -d /tmp/triton_cache.tgz /tmp/tcache_rest/tcache
    for piece in $(ls /tmp/tcache_rest | head -4); do mv "/tmp/tcache_rest/$piece" "$out/"; done
    echo "Triton cache pieces left for the next call: $(ls /tmp/tcache_rest | wc -l)"
  }
  bring_cache_rest() {
    if [ -d /tmp/tcache_rest ]; then mv /tmp/tcache_rest/* "$out/" 2>/dev/null; fi
  }
  if ls /tmp/tcache/tcache* >/dev/null 2>&1 && [ ! -d "$HOME/.triton/cache" ]; then
    # Triton's cache of an earlier machine (bring_triton_cache's pieces, carried and copied to
    # /tmp/tcache): fla's kernels compiled and autotuned already.
    mkdir -p "$HOME/.triton" && cat /tmp/tcache/tcache* | tar -C "$HOME/.triton" -xzf - \
      && echo "Triton cache unpacked: $(du -sh "$HOME/.triton/cache" | cut -f1)"
  fi
  case "${2:-check}" in
    vlcheck)
      # The VL and VL-MoE families' GPU tests at 8k (fla and our reference against float64),
      # then the VL step both sides (the tower's kernel as the family's auto picks it).
      run gpu_tests_qwen35_vl ${QWEN35_TEST_S:-280} python3 -m pytest -q -s -p no:cacheprovider \
        -o addopts="" tests/gpu/test_qwen35_families_fla_gpu.py -k "8k and vl"
      grep -E "rel error|truth on|loss:|worst|tokens:|passed|failed|Error" \
        "$out/gpu_tests_qwen35_vl.log" | cut -c1-400 | head -40
      run bench_vl_qwen35 ${QWEN35_VL_S:-300} python3 -m tests.perf.bench_vl \
        "$out/vl_qwen3_5_$card.json" --family qwen3_5_vl
      tail -c 700 "$out/bench_vl_qwen35.log" ;;
    tests32)
      # The 32k cases of the families named in the third argument (one or several of
      # qwen3_5, qwen3_5_moe, qwen3_5_vl, qwen3_5_vl_moe, in one quoted word), one after
      # another, each given QWEN35_TEST_S seconds. Their float64 truth runs on the GPU (on the
      # CPU it took 596 s and 16 GB for the text family on 2 cores here). On a warm H100 at
      # 521b2a9 (fla compiled by `tests`): text 41 s, MoE 26 s, VL 120 s, VL-MoE 27 s, so all
      # four fit one call.
      for family in ${3:?name one or more families}; do
        run gpu_tests_qwen35_32k_$family ${QWEN35_TEST_S:-560} python3 -m pytest -q -s \
          -p no:cacheprovider -o addopts="" \
          "tests/gpu/test_qwen35_families_fla_gpu.py::test_family_fla_and_reference_against_float64[$family-32k]"
        grep -E "tokens|truth on|loss:|worst|passed|failed|Error" \
          "$out/gpu_tests_qwen35_32k_$family.log" | cut -c1-600 | head -20
      done ;;
    moe)
      # The Qwen3.5-MoE cut against transformers' grouped_mm experts, in a call to itself; a
      # third argument sets the sequence (default 4096; another one names the file _seqN).
      # On a fresh H100 at 8f37787 our row's warmup took about 6 minutes (fla's cold compile
      # and autotuning for the cut's heads), so transformers' row ran out of the call; the
      # next call on the warm machine ran both rows at 2048 in 190 s. On a fresh machine run
      # `moe 2048` first, then `moe` in the next call. At 4096 on an H100 (8b5da20, the call
      # after the families' tests on that machine: 299 s) transformers' row ran out of memory
      # with 7.9 GiB of its cache reserved but unallocated; under expandable segments it fit
      # (67.8 GiB) and both rows took 60 s. Both sides run in one process, so both get the
      # same allocator (the JSON's cuda_alloc_conf).
      moe_cut ${QWEN35_MOE_S:-560} "${3:-4096}" ;;
    gates)
      # diag_qwen35_gates.py: where fla's A_log / dt_bias error comes from (the rule, then the
      # text model, fla on bf16 and fp32 operands and with its conv weight rounded, and the
      # reference, against float64), cases in the third argument (default 32k,8k). On a
      # fresh H100 at a5810b4 fla's cold compile for the rule's bf16 and fp32 operands took
      # 421 s of the first row; the 32k model row took 27 s on the warm machine after.
      # QWEN35_GATES_ARGS passes more (say `--measure model --model-rules
      # fla,fla_conv_weight_bf16,reference` to spare the compile for fp32 operands).
      run diag_qwen35_gates ${QWEN35_GATES_S:-560} python3 -m tests.perf.diag_qwen35_gates \
        "$out/diag_qwen35_gates_$card.json" --cases "${3:-32k,8k}" ${QWEN35_GATES_ARGS:-}
      grep -E "^(rule|model) " "$out/diag_qwen35_gates.log" | cut -c1-900 ;;
    tests)
      # The fla tests and the families' 8k cases (two float64 truths each, CPU and GPU). On a
      # fresh H100 at 521b2a9 (fla compiling cold) 500 s ended in the VL family's case: give
      # it a call to itself after the Triton carry, or run `vlcheck` for the VL families.
      run gpu_tests_qwen35 ${QWEN35_TEST_S:-540} python3 -m pytest -q -s -p no:cacheprovider \
        -o addopts="" tests/gpu/test_qwen35_fla_gpu.py tests/gpu/test_qwen35_families_fla_gpu.py \
        -k "not (families and 32k)"
      grep -E "rel error|truth on|loss:|A_log|worst|: reference bf16|passed|failed|Error" \
        "$out/gpu_tests_qwen35.log" | cut -c1-600 | head -60 ;;
    check)
      # The score tests (their float64 truth is CPU work) beside the bf16 model test: both only
      # compare numbers, so they may share the GPU.
      timeout 560 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" \
        tests/gpu/test_qwen35_score_gpu.py > "$out/gpu_tests_qwen35_score.log" 2>&1 &
      run gpu_tests_qwen35_model 420 python3 -m pytest -q -s -p no:cacheprovider \
        -o addopts="" tests/gpu/test_qwen35_fla_gpu.py -k "model or auto_falls_back"
      grep -E "loss:|kind|A_log|dt_bias|passed|failed|Error" "$out/gpu_tests_qwen35_model.log" \
        | cut -c1-400 | head -40
      wait
      echo "== score"
      grep -E "max \||fp32|bf16:|passed|failed|Error" "$out/gpu_tests_qwen35_score.log" \
        | cut -c1-400 | head -40 ;;
    score)
      run gpu_tests_qwen35_score 560 python3 -m pytest -q -s -p no:cacheprovider \
        -o addopts="" tests/gpu/test_qwen35_score_gpu.py
      grep -E "max \||fp32|bf16:|passed|failed|Error" "$out/gpu_tests_qwen35_score.log" \
        | cut -c1-400 | head -40 ;;
    bench)
      run bench_qwen35_mtp 300 python3 -m tests.perf.bench_qwen35_mtp "$out/qwen35_mtp_$card.json"
      tail -c 1200 "$out/bench_qwen35_mtp.log"
      run bench_qwen35_8k ${QWEN35_BENCH_S:-420} python3 -m tests.perf.bench_qwen35 \
        "$out/qwen35_$card.json" --seq 8192 --profile "$out/profile_qwen35_layer_$card.txt"
      tail -c 1500 "$out/bench_qwen35_8k.log"
      grep -E "^== |Self CUDA time total" "$out/profile_qwen35_layer_$card.txt" ;;
    rest)
      # A fresh machine after Triton's cache of an earlier one was unpacked into ~/.triton:
      # the MTP step, then the Qwen3.5-0.8B VL step on real images against transformers.
      run bench_qwen35_mtp 200 python3 -m tests.perf.bench_qwen35_mtp "$out/qwen35_mtp_$card.json"
      tail -c 1200 "$out/bench_qwen35_mtp.log"
      run bench_vl_qwen35 300 python3 -m tests.perf.bench_vl "$out/vl_qwen3_5_$card.json" \
        --family qwen3_5_vl
      tail -c 2500 "$out/bench_vl_qwen35.log" ;;
    diag)
      # The Qwen3.5-0.8B VL step profiled, ours then transformers' (profile_vl.py; where the
      # time goes, not a reported timing), the GPU to itself. Ours compiles fla's kernels
      # first on a fresh machine: at 8406033 its profile, given 270 s on 4 cores beside the
      # GPU tests, ran out of time; run this mode alone. A third argument picks one side
      # (mpcore or hf). QWEN35_STACKS=aten::index lists that operator's call sites.
      for side in ${3:-mpcore hf}; do
        run profile_vl_$side ${QWEN35_PROFILE_S:-420} python3 -m tests.perf.profile_vl \
          "$out/profile_vl_qwen3_5_${side}_$card.txt" --side $side --family qwen3_5_vl \
          ${QWEN35_STACKS:+--stacks "$QWEN35_STACKS"}
        grep -E "side:|fwd:|device idle|Self CUDA time total|host sync" \
          "$out/profile_vl_qwen3_5_${side}_$card.txt" | cut -c1-200 | head -12
        tail -3 "$out/profile_vl_$side.log" | cut -c1-300; rm -f "$out/profile_vl_$side.log"
      done
      bring_triton_cache ;;
    vlsplit)
      # The VL step's time split: bench_vl both sides on this card, ours with the flash vision
      # kernel instead of cuDNN, then the same decoder's text step (bench_qwen35 at 8192) both
      # sides: the VL step minus the text step is what the tower and the VL inputs cost.
      run bench_vl_qwen35 ${QWEN35_VL_S:-300} python3 -m tests.perf.bench_vl \
        "$out/vl_qwen3_5_$card.json" --family qwen3_5_vl
      tail -c 1200 "$out/bench_vl_qwen35.log"
      run bench_vl_qwen35_flash 120 python3 -m tests.perf.bench_vl \
        "$out/vl_qwen3_5_${card}_flash.json" --family qwen3_5_vl --skip-hf --vision-attention flash
      tail -c 600 "$out/bench_vl_qwen35_flash.log"
      run bench_qwen35_8k 180 python3 -m tests.perf.bench_qwen35 "$out/qwen35_$card.json" \
        --seq 8192 --skip-layer
      tail -c 1200 "$out/bench_qwen35_8k.log"
      bring_cache_rest ;;
    peers)
      # The peers an H100 cannot hold (transformers' full-vocabulary logits at 32k, the MoE
      # cut's experts): the 32k text step both sides, then the Qwen3.5-MoE cut against
      # transformers' grouped_mm experts (our row is written before theirs start); logs stay
      # on the machine (their tails print), Triton's cache comes back if whole.
      bench32k 240
      moe_cut ${QWEN35_MOE_S:-300} 4096
      rm -f "$out/bench_qwen35_32k.log" "$out/bench_moe_qwen35.log"
      bring_triton_cache ;;
    bench32)
      bench32k 400
      bring_triton_cache ;;
  esac
else
  run model 240 python -m tests.perf.bench_model "$out/model_h200.json" --steps 10 --warmup 3
  run train 240 python -m tests.perf.bench_train "$out/train_h200.json" --steps 10 --warmup 3
fi
