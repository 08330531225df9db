#!/bin/bash
# Run on a lent GPU machine from a copy of this tree (see docs/benchmarks.md): installs the
# carried wheels into /tmp/site, makes the package importable from /tmp/pkg (omniflow with
# its dsl/ and kernels/ linked in, as setup.py's package-dir maps them), then runs the
# parts named as arguments: setup tests steps build streaming. Logs go to $OUT (or /tmp/out).
# Wheels: whl/ holds what the GPU image lacks (lark, msgspec, pyzmq, rich, ...) and the
# transformers this tree is tested with. Python runs with -P (or from /tmp), so that this
# directory's omniflow/, which lacks dsl/ and kernels/, is not the one imported.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OMNIFLOW_CACHE=${OMNIFLOW_CACHE:-/tmp/omniflow-cache}
export PYTHONPATH=/tmp/pkg:/tmp/site
for part in "$@"; do
  start=$(date +%s)
  case $part in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site whl/*.whl > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
      rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r omniflow /tmp/pkg/ \
        && ln -s "$here/dsl" /tmp/pkg/omniflow/dsl && ln -s "$here/kernels" /tmp/pkg/omniflow/kernels
      python3 -P -c "import torch, transformers, triton, omniflow.kernels.sampling, omniflow.dsl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/setup.log"
      ;;
    tests)
      timeout ${TESTS_S:-200} python3 -P -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
        tests/backends/test_transformers_ar.py tests/backends/test_omni_fidelity.py \
        tests/backends/test_scaled_decode.py tests/kernels/test_sampling.py \
        tests/kernels/test_rms_norm.py tests/kernels/test_rope_cache.py \
        tests/kernels/test_silu_mul.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
      ;;
    steps)
      timeout ${STEPS_S:-150} python3 benchmarks/stage_steps.py --batches 1 10 --steps 24 2>&1 | tee "$OUT/stage_steps.log"
      ;;
    build)
      timeout ${BUILD_S:-200} python3 -P -c "from omniflow.checkpoints.scaled import scaled_checkpoint; print(scaled_checkpoint(1.0, 'cuda'))" 2>&1 | tail -3 | tee "$OUT/build.log"
      ;;
    streaming)
      # From /tmp: executors start as `python -m omniflow.runtime.executor`, which puts the
      # working directory first on sys.path, and this tree's omniflow/ lacks dsl/ and kernels/.
      (cd /tmp && timeout ${STREAMING_S:-330} python3 "$here/benchmarks/streaming.py" --devices 1xH200 --scaled 1 \
        --concurrency 1 10 --baseline-requests 1 --max-tokens 32 --audio-tokens 160 \
        --decode ${STREAMING_DECODE:-eager graphs} --variants streaming) 2>&1 | grep -v -i "warn\|model config" \
        | tee "$OUT/streaming.log"
      ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.log"
done
