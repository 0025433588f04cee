#!/usr/bin/env bash
# One device call for the engine's speed at agent scale (docs: bench/RESULTS.md): the GPU tests of the
# engine and decode kernel, then decode_sweep.py, prefill_long.py and, with REPLAY=1, agent_replay.py.
# Each part runs under its own time limit; logs and JSON rows go to $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -x -k "not presets" \
      tests/test_ops_decode_attention.py tests/test_engine_gpu.py tests/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
fi
if [ "${SWEEP:-1}" = 1 ]; then
  timeout "${SWEEP_LIMIT:-200}" python3 bench/decode_sweep.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" | grep -v '^{' | tail -20
fi
if [ "${PREFILL:-1}" = 1 ]; then
  timeout "${PREFILL_LIMIT:-150}" python3 bench/prefill_long.py ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.log" | tail -6
fi
if [ "${REPLAY:-0}" = 1 ]; then
  timeout "${REPLAY_LIMIT:-560}" python3 bench/agent_replay.py ${REPLAY_ARGS:-} 2>&1 | tee "$OUT/replay.log" | grep -v '^{' | tail -30
fi
