#!/usr/bin/env bash
# The GPU checks and figures of docs/benchmarks.md ("On one GPU"), in one run on one CUDA GPU:
#   bash benchmarks/gpu.sh [LOG]            (default LOG: gpu.log; run from the repository root)
# Settings (environment): ROUNDS=N repeats the timed benchmarks N times (default 1; the docs
# give medians over runs); PYTEST_K selects tests/test_cuda.py's tests (pytest -k; empty: all,
# "none": skip them); HF_IMPLS the transformers experts implementations to time (default
# "eager grouped_mm"); COMPILE=0 skips the compiled runs; PARTS the parts to run, among
# "tests layer hf optim compile exchange" (default: all of them; "exchange": the fixed-buffer
# exchange against the all-to-all one, 4 processes sharing the GPU over gloo).
# The package is used from the checkout (PYTHONPATH), with whatever torch the machine has.
# Each step has its own time limit, so one that hangs or fails does not stop the others.
set -u
LOG=${1:-gpu.log}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# torch older than 2.13 (the machine's own build): its eager functional collectives over gloo
# crash on CUDA tensors; benchmarks/gloo_cuda_shim routes them through c10d (see its docstring)
if ! $PY -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 13))"
then
    export PYTHONPATH=$PWD/benchmarks/gloo_cuda_shim:$PYTHONPATH
    echo "torch older than 2.13: eager functional collectives through c10d (gloo_cuda_shim)"
fi
ROUNDS=${ROUNDS:-1}
PYTEST_K=${PYTEST_K:-}
HF_IMPLS=${HF_IMPLS:-eager grouped_mm}
PARTS=" ${PARTS:-tests layer hf optim compile exchange} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
step() {  # step SECONDS COMMAND...: run, log, and record the exit status
    local limit=$1; shift
    echo "=== $(date -u +%T) $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "=== rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$LOG"
}
: > "$LOG"
step 60 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
step 60 $PY -c "import torch, dtensor_moe; print('torch', torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())"
# correctness on the device
if [ "$PYTEST_K" != none ] && part tests; then
    step 240 $PY -m pytest -q -s -p no:cacheprovider --durations=8 tests/test_cuda.py \
        ${PYTEST_K:+-k "$PYTEST_K"}
fi
B="$PY benchmarks/moe_layer.py --device cuda --dtype bf16 --full-size --warmup 3 --repeats 21"
H="$PY benchmarks/hf_block.py --device cuda --dtype bf16 --warmup 3 --repeats 11 --impls $HF_IMPLS"
X="$PY benchmarks/exchanges.py --exchanges fixed,all_to_all --device cuda --dtype bf16 \
--warmup 3 --repeats 11"
QWEN3="--tokens 8192 --dim 2048 --hidden 768 --experts 128 --top-k 8"
for round in $(seq "$ROUNDS"); do
    echo "=== round $round of $ROUNDS" | tee -a "$LOG"
    if part layer; then
    # the layer at the models' own sizes, bf16, against its expert-compute floor
    step 60 $B --preset qwen3 --tokens 8192
    step 60 $B --preset qwen3 --tokens 8192 --plain-routed-step
    step 60 $B --preset mixtral --tokens 8192
    step 90 $B --preset deepseek-v3 --tokens 4096
    fi
    if part hf; then
    # against what a transformers user runs: the HF block, same weights
    step 60 $H --family qwen3_moe $QWEN3
    step 60 $H --family qwen3_moe $QWEN3 --plain-routed-step
    step 60 $H --family deepseek_v3 --tokens 8192 --dim 2048 --hidden 512 --experts 256 --top-k 8
    step 60 $H --family mixtral --tokens 8192 --dim 4096 --hidden 14336 --experts 8 --top-k 2
    fi
    # the fused optimizer over two meshes against torch's own on plain tensors
    part optim && step 90 $PY benchmarks/optimizer_step.py --device cuda
    if part exchange; then
    # the fixed-buffer exchange against the all-to-all one on CUDA tensors, 4 ranks on the GPU
    # (not --full-size: each of the 4 processes builds the whole layer before it is sharded)
    step 150 $X --presets default,qwen3,deepseek-v3 --layouts ep4,sp2ep
    fi
done
if [ "${COMPILE:-1}" = 1 ] && part exchange; then  # the fixed exchange compiled whole
    step 120 $X --presets default --layouts ep4 --compile
    step 400 $X --presets qwen3 --layouts ep4 --compile  # 128 experts: compiling takes minutes
fi
if [ "${COMPILE:-1}" = 1 ] && part compile; then  # compiled against eager: Triton kernels
    step 150 $B --preset qwen3 --tokens 8192 --compile
    step 150 $B --preset deepseek-v3 --tokens 4096 --compile
fi
echo "=== done $(date -u +%T)" | tee -a "$LOG"
