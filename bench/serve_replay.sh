#!/usr/bin/env bash
# Issue 11's H200 run: `minakv serve gpt-oss-20b --load-format dummy` (random bf16 weights, the real
# shapes and tokenizer), then `minakv bench replay` through its OpenAI API with three policies, 8 tasks at
# once. Writes replay.json, requests.jsonl and the PNG plots to $OUT/replay (default /tmp/replay).
# The GPT-OSS tokenizer and the tiny-gpt-oss counter come from MINAKV_CACHE (no quicktok on the device):
# build them here with `MINAKV_CACHE=$PWD/.cache/gpu python -c "from minakv.agent import TokenCounter;
# TokenCounter.from_model('tiny-gpt-oss')"` and carry .cache/gpu (drop the tiny model's safetensors).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MINAKV_CACHE=${MINAKV_CACHE:-$PWD/.cache/gpu}
OUT=${OUT:-/tmp}
PORT=${PORT:-8123}
python3 -m minakv.cli serve "${MODEL:-gpt-oss-20b}" --load-format dummy --port "$PORT" ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/serve.log"; exit 1; }
    sleep 1
done
echo "server up after ${SECONDS}s"
python3 -m minakv.cli bench replay --url "http://127.0.0.1:$PORT" --tasks 8 --rounds 24 \
    --tool-tokens 2000 --output-tokens 48 --tokenizer tiny-gpt-oss --no-progress \
    --policies "${POLICIES:-plain,kv_drop:K=4:every=1:first=5,text_drop:K=4}" --out "$OUT/replay" ${REPLAY_ARGS:-}
echo "replay exit: $?"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^minakv_(prompt|generation|cache|kv)" | head -20 > "$OUT/metrics.txt"
tail -5 "$OUT/serve.log"
