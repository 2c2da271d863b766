#!/usr/bin/env bash
# The main job, end to end: serve the default model, ask it one question over the OpenAI API, stop.
# Set KEEP_SERVING=1 to leave the server running (foreground) after the answer.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
LOG=${LOG:-/tmp/llmserve-serve.log}
.venv/bin/llmserve serve --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "serving the default model on http://127.0.0.1:$PORT (log: $LOG); waiting until it is ready..."
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then cat "$LOG"; echo "server exited" >&2; exit 1; fi
  sleep 1
done
grep -E "serving|KV cache" "$LOG" | tail -3
echo "POST /v1/chat/completions:"
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m",
  "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
  "temperature": 0, "max_tokens": 64}' | .venv/bin/python -c '
import json, sys
r = json.load(sys.stdin)
print("answer:", r["choices"][0]["message"]["content"])
print("usage:", r["usage"])'
if [ "${KEEP_SERVING:-0}" = 1 ]; then trap - EXIT; wait $SERVER; fi
