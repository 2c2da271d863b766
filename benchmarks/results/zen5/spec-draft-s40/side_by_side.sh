#!/bin/bash
# Session 40: the default's speculation drafts with a registered draft where one is installed (Qwen2.5-Coder-1.5B:
# the 0.5B). Three servers up side by side, the peer workload (shared 200-token prefix, 256-token prompts, 128
# greedy tokens; WORKLOAD=humaneval for HumanEval's prompts) alternated between them per round and level:
#   8011 the default (auto: the 0.5B draft below 4 running requests)
#   8013 --speculative-config off
#   8012 llama-server on the same Q4_K_M file
# (auto as session 39 had it, n-gram lookup, is a fourth 1.5B server: ~7 GB each, more than 24 GB in all)
# Usage: LEVELS="1:8 2:8 4:16" bash side_by_side.sh ROUNDS   (results under OUT, default this folder)
cd /work/main
MODEL=qwen2.5-coder-1.5b
OUT=${OUT:-benchmarks/results/zen5/spec-draft-s40}/${WORKLOAD:-shared-prefix}
mkdir -p $OUT
P=$HOME/peers
PORTS="8011 8013 8012"
# one at a time: a loading 1.5B holds its GGUF dequantized to float32 (~7 GB) until its weights are packed
up() { for i in $(seq 200); do sleep 3; curl -sf localhost:$1/health >/dev/null && return; done; }
.venv/bin/python -m llmserve.cli serve $MODEL --port 8011 > $OUT/auto.log 2>&1 &
A=$!; up 8011
.venv/bin/python -m llmserve.cli serve $MODEL --port 8013 --speculative-config off > $OUT/off.log 2>&1 &
B=$!; up 8013
NP=32 PORT=8012 bash /work/shared/peers/servers/llama_server.sh -m $P/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
  --alias $MODEL > $OUT/llama.log 2>&1 &
L=$!; up 8012
for level in ${LEVELS:-1:8}; do
  c=${level%%:*}; n=${level##*:}
  for r in $(seq ${1:-2}); do
    for port in $PORTS; do
      .venv/bin/python -m llmserve.cli bench --base-url http://127.0.0.1:$port --model $MODEL \
        --workload ${WORKLOAD:-shared-prefix} --prefix-len 200 --input-len 256 --output-len 128 --seed $((1234+r)) \
        --temperature 0 --concurrency $c --num-requests $n --warmup 1 --tokenizer $P/models/qwen2.5-coder-1.5b-hf \
        --no-progress --out $OUT/c$c-$port-$r.json 2>&1 | grep "^c=$c " | sed "s/^/round $r port $port /"
    done
  done
done
curl -s localhost:8011/metrics | grep spec_decode | grep -v "^#" > $OUT/spec_metrics.txt
kill $A $B $L
