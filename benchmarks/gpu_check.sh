#!/usr/bin/env bash
# The one-GPU check of issue #10, in under 5 minutes: ResNet-18 at 299x299x3, batch 32,
# mixed precision (mixed_float16, ROLL tangents in float16):
#
#   1. vanilla vs sampled-ROLL training steps (1, 6 and 120 axes per channel, the paper's
#      Caltech-256 setting), interleaved: ms/step, the per-direction cost
#      (roll - vanilla) / (directions * vanilla) and the peak GPU memory of each step;
#   2. the exact-certify throughput (l1, l2, l_inf radii through all 268,203 input axes)
#      of one image, float32 twin.
#
# It prints the card's name (nvidia-smi and TensorFlow) with the figures; put them in the
# ResNet table of benchmarks/README.md with that name.
#
#   bash benchmarks/gpu_check.sh                       # on a machine with one GPU
#   GPU_CHECK_QUICK=1 bash benchmarks/gpu_check.sh     # tiny sizes, end to end on a CPU
#
# Environment: PYTHON (default .venv/bin/python if present, else python3);
# GPU_CHECK_INSTALL=0 never installs (by default, when TensorFlow sees no GPU, it runs
# `pip install '.[gpu]'` into $PYTHON first); GPU_CHECK_RIGOR (default float32; e.g.
# "float32,float64" also times the default rigor of certify, several times slower on GPUs);
# GPU_CHECK_BUDGET (bytes of ROLL tangents per chunk, default 16 GiB) and
# GPU_CHECK_CERTIFY_BUDGET (default 16 GiB) for cards with less memory.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export TF_CPP_MIN_LOG_LEVEL=2
quick=${GPU_CHECK_QUICK:-0}
start=$(date +%s)

echo "== keras_roll GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
    echo "nvidia-smi: not available"
fi

gpus() {
    "$PYTHON" -c 'import tensorflow as tf; print(len(tf.config.list_physical_devices("GPU")))' \
        2>/dev/null || echo 0
}
n=$(gpus)
if [ "$n" = 0 ] && [ "$quick" != 1 ] && [ "${GPU_CHECK_INSTALL:-1}" = 1 ]; then
    echo "TensorFlow sees no GPU: installing '.[gpu]' (tensorflow[and-cuda]) into $PYTHON"
    "$PYTHON" -m pip install --quiet '.[gpu]' || echo "pip install '.[gpu]' failed"
    n=$(gpus)
fi
if [ "$n" = 0 ] && [ "$quick" != 1 ]; then
    echo "no GPU visible to TensorFlow; on a CPU, run GPU_CHECK_QUICK=1 bash $0"
    exit 1
fi

if [ "$quick" = 1 ]; then  # end to end on a (loaded) CPU: small, without the 5-minute limit
    size=16 batch=2 samples=1,2 budget=$((1 << 28)) cbudget=$((1 << 28))
    rigor=${GPU_CHECK_RIGOR:-float32,float64} steps_s=60 steps_t=900 certify_t=600
else
    size=299 batch=32 samples=1,6,120
    budget=${GPU_CHECK_BUDGET:-$((1 << 34))} cbudget=${GPU_CHECK_CERTIFY_BUDGET:-$((1 << 34))}
    rigor=${GPU_CHECK_RIGOR:-float32} steps_s=100 steps_t=200 certify_t=75
fi

echo "== 1. ResNet-18 training steps: vanilla vs sampled ROLL"
timeout "$steps_t" "$PYTHON" -m benchmarks.resnet --image_size="$size" --batch="$batch" \
    --samples="$samples" --mixed_precision --memory_budget="$budget" --repeats=3 \
    --max_seconds="$steps_s"
rc=$?
[ "$rc" = 0 ] || echo "step timing stopped (exit $rc; 124: over ${steps_t} s)"

echo "== 2. exact certify throughput"
timeout "$certify_t" "$PYTHON" -m benchmarks.resnet --certify_only --image_size="$size" \
    --certify_examples=1 --certify_rigor="$rigor" --certify_budget="$cbudget" --mixed_precision
rc=$?
[ "$rc" = 0 ] || echo "certify timing stopped (exit $rc; 124: over ${certify_t} s)"
echo "== done in $(( $(date +%s) - start )) s"
