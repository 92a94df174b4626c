#!/usr/bin/env bash
# Quire's GPU checks in one go, for a machine with an NVIDIA GPU (issue 3, section 5).
#
#   benchmarks/gpu.sh [results-dir]        (default: /tmp/quire-gpu-results)
#
# Needs the engine installed with CUDA torch and triton: pip install -e '.[engine,test]'.
# Runs every step even when one fails, writes each step's output under results-dir, prints a
# summary and exits non-zero if any step failed. Set PYTHON to pick the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
# `quire-engine` when installed; the same CLI from this checkout otherwise.
export PYTHONPATH="$PWD/engine${PYTHONPATH:+:$PYTHONPATH}"
QUIRE=("$PYTHON" -m quire_engine.cli)
command -v quire-engine >/dev/null && QUIRE=(quire-engine)
RESULTS=${1:-/tmp/quire-gpu-results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
declare -a SUMMARY=()
FAILED=0

step() {  # step <name> <output file> <command...>; a .json output keeps stdout only
    local name=$1 log=$RESULTS/$2
    shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    if [[ $log == *.json ]]; then "$@" | tee "$log"; else "$@" 2>&1 | tee "$log"; fi
    local rc=${PIPESTATUS[0]}
    SUMMARY+=("$(printf '%-34s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - start)) "$log")")
    [[ $rc -eq 0 ]] || FAILED=1
}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu.sh: no CUDA GPU visible to torch; nothing to run" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$RESULTS/gpu.csv" || true
"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
    torch.cuda.get_device_name())' | tee "$RESULTS/versions.txt"

# 1. Triton kernels vs their torch references on CUDA (fp32 and bf16), write_kv, swap, bench smoke;
#    over 8-bit KV caches (int8, fp8 e4m3/e5m2): the quantizing write bit-exact, attention within
#    vLLM's fp8-KV tolerance, and the engine end to end with --kv-cache-dtype.
#    The LoRA shrink/expand kernels against their references.
KERNEL_TESTS=(tests/engine_tests/kernels/test_kernels.py tests/engine_tests/kernels/test_triton_kv8.py
    tests/engine_tests/kernels/test_lora_triton.py)
step "kernel tests (pytest -m gpu)" kernel-tests.log \
    "$PYTHON" -m pytest -m gpu "${KERNEL_TESTS[@]}" -q -rs

# 2. Decode attention bandwidth: batch 64, context 2048, 32/8 heads, head size 128, bf16,
#    against torch SDPA on a contiguous cache; fraction of the H200's 4.8 TB/s.
step "bench kernel" bench-kernel.json "${QUIRE[@]}" bench kernel --json --peak-gbps 4800

# 3. HF equivalence on CUDA (tests/engine_tests/model/test_gpu_equivalence.py): token-exact in float32
#    for every architecture; bf16 logits within tolerance on a ~134M-parameter Llama, printing
#    where greedy outputs first diverge (-s keeps that JSON line in the log).
gpu_tests_outside_kernels() {  # pytest exits 5 when it collects nothing: not a failure here
    "$PYTHON" -m pytest -m gpu tests -q -rs -s "${KERNEL_TESTS[@]/#/--ignore=}"
    local rc=$?
    [[ $rc -eq 5 ]] && echo "(no gpu tests outside the kernels yet)" && return 0
    return $rc
}
step "gpu tests outside kernels" gpu-tests.log gpu_tests_outside_kernels

# 4. Throughput: Quire vs HF static vs HF continuous batching at one KV budget, bf16, a ~300M
#    Llama built from a config, 256 ShareGPT-like requests.
step "bench throughput" bench-throughput.json "${QUIRE[@]}" bench throughput --json \
    --device cuda --dtype bfloat16 --hidden-size 1024 --layers 16 --vocab-size 32000 \
    --num-requests 256 --mean-prompt 200 --mean-output 180 --max-model-len 2048 --budget-seqs 16

# 5. Tensor parallelism on two GPUs (NCCL): the same workload as step 4, Quire at TP=1 and TP=2 in
#    one run (speed-up, collectives' share of the wall time, plan send cost per step). It needs two
#    or more GPUs; on one it is skipped, and the summary says so.
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
if [[ $GPUS -ge 2 ]]; then
    step "bench throughput TP=2 vs TP=1" bench-throughput-tp2.json "${QUIRE[@]}" bench throughput \
        --json --systems quire --tensor-parallel-size 2 \
        --device cuda --dtype bfloat16 --hidden-size 1024 --layers 16 --vocab-size 32000 \
        --num-requests 256 --mean-prompt 200 --mean-output 180 --max-model-len 2048 --budget-seqs 16
else
    echo "=== tensor parallelism: SKIPPED, this machine has $GPUS GPU (it needs 2 or more)"
    SUMMARY+=("$(printf '%-34s SKIPPED: %s GPU, needs 2 or more' "tensor parallelism" "$GPUS")")
fi

echo
echo "=== summary (results in $RESULTS/)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
