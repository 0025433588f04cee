#!/usr/bin/env bash
# One device call for the engine's GPU path: the GPU tests (kernels not covered by bench/run_h200.py, MoE
# paths, model logits, the engine), then the end-to-end decode benchmark (bench/e2e_decode.py). Logs go to $OUT.
# The tiny presets cannot be built there (no quicktok-v1): build them here into .cache/minakv, e.g.
#   MINAKV_CACHE=$PWD/.cache/minakv python -c "from minakv.presets import resolve_model as r; r('tiny-gpt-oss'); r('tiny-minimax-m2')"
# drop tiny-gpt-oss's tokenizer.json (11 MB, unused by token-id prompts), and carry .cache/minakv/presets.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MINAKV_CACHE=$PWD/.cache/minakv
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${TEST_LIMIT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -s ${TEST_ARGS:-} \
    tests/test_ops_kv_store.py tests/test_moe_paths.py tests/test_model_gpu.py tests/test_engine_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^$" | tail -25
echo "tests exit: ${PIPESTATUS[0]}"
timeout "${BENCH_LIMIT:-300}" python3 bench/e2e_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | tail -30
echo "bench exit: ${PIPESTATUS[0]}"
