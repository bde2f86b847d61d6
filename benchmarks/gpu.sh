#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, JAX's CUDA build and a CUDA build of torch: the native GPU
# tests (cuDNN, the Pallas kernels compiled for the device, the pure-JAX paths, the automatic
# choice), then the benchmark suite in bfloat16 (layer and KV-cache decoding, a short length sweep).
#
#     bash benchmarks/gpu.sh [OUTDIR]      # default: benchmarks/results
#
# Each stage has its own time limit (SWEEP_LIMIT=0 skips the sweep) and the next runs whatever the last gave; everything is
# logged to OUTDIR/gpu-run.log, the benchmark results go to OUTDIR as usual.
set -u
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
log="$out/gpu-run.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date +%T))" | tee -a "$log"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$log"
}

stage versions 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
    $py -c 'import jax, flax, torch, numpy; print(\"jax\", jax.__version__, \"flax\", flax.__version__, \"torch\", torch.__version__, \"numpy\", numpy.__version__, jax.devices())'"
# One GPU shared by the test workers: no worker may take most of its memory up front.
XLA_PYTHON_CLIENT_PREALLOCATE=false stage tests "${TEST_LIMIT:-300}" "$py" -m pytest -p no:cacheprovider -n 4 -rs \
    parity_tests/core/test_conformance.py parity_tests/core/test_registry.py \
    -k "gpu or cudnn or ((pallas_triton or pallas_decode) and not interpret)"
stage layer-decode "${LAYER_LIMIT:-240}" "$py" -m benchmarks.run --parts layer,decode --repeats 20 --out "$out"
[ "${SWEEP_LIMIT:-240}" -gt 0 ] && stage sweep "${SWEEP_LIMIT:-240}" "$py" -m benchmarks.run --parts sweep --lengths "${LENGTHS:-2048,16384}" --repeats 10 \
    --out "$out"
