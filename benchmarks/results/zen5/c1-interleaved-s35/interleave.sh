#!/bin/bash
# llmserve (default) and llama-server (Q4_K_M as shipped) up side by side, c=1 bench alternated; OUT = this folder
cd /work/main
P=$HOME/peers
.venv/bin/python -m llmserve.cli serve qwen2.5-coder-1.5b --port 8011 > OUT/il-llmserve.log 2>&1 &
LS=$!
NP=32 PORT=8012 bash /work/shared/peers/servers/llama_server.sh -m $P/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --alias qwen2.5-coder-1.5b > OUT/il-llama.log 2>&1 &
LL=$!
for i in $(seq 100); do sleep 3; curl -sf localhost:8011/health >/dev/null && curl -sf localhost:8012/health >/dev/null && break; done
for r in 1 2 3; do  # run twice: rounds 1-3, then 4-6 (servers restarted)
  for port in 8011 8012; do
    .venv/bin/python -m llmserve.cli bench --base-url http://127.0.0.1:$port --model qwen2.5-coder-1.5b --workload shared-prefix --prefix-len 200 --input-len 256 --output-len 128 --seed $((1234+r)) --temperature 0 --concurrency 1 --num-requests 8 --warmup 1 --tokenizer $P/models/qwen2.5-coder-1.5b-hf --no-progress --out OUT/il-$port-$r.json 2>&1 | grep "^c=1" | sed "s/^/round $r port $port /"
  done
done
kill $LS $LL
