#!/bin/bash
# Qwen2.5-Coder-0.5B: perplexity (gensim's Lee corpus, first 4096 tokens, windows of 512, stride 256) with every
# token through the small-step kernels (--max-num-batched-tokens 32), then HumanEval pass@1: the weights as loaded
# (the default before session 60), the new default (int4 + int8 on the file's grids, Q8_0 inputs), and the new
# default with ~16-bit inputs.
set -e
D=benchmarks/results/int8-grids-s60
E=".venv/bin/llmserve eval qwen2.5-coder-0.5b"
$E --tasks perplexity --ppl-tokens 4096 --max-num-batched-tokens 32 --quantization none --label as-loaded --out $D/ppl_as_loaded.json
$E --tasks perplexity --ppl-tokens 4096 --max-num-batched-tokens 32 --label default --out $D/ppl_default.json
$E --tasks perplexity --ppl-tokens 4096 --max-num-batched-tokens 32 --no-q8-activations --label default-16bit-inputs --out $D/ppl_default_16bit.json
$E --tasks humaneval --quantization none --label as-loaded --out $D/humaneval_as_loaded.json
$E --tasks humaneval --label default --out $D/humaneval_default.json
