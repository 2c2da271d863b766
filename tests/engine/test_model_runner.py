"""What a start that compiles nothing loads: none of torch's compiler stack (Dynamo, Inductor, the symbolic shapes),
a large share of the default model's start (docs/performance.md, "Start-up"). Run in a fresh interpreter: this one
has imported them for other tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes", "sympy")

_START_AND_ANSWER = """
import json, sys
from llmserve import LLM, SamplingParams
llm = LLM(kv_cache_memory_gb=0.1)
[out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({"compile": llm.engine.plan.compile, "tokens": len(out.outputs[0].token_ids),
                  "loaded": [m for m in %r if m in sys.modules]}))
"""


@pytest.mark.processes
def test_a_start_without_compiling_leaves_the_compiler_unimported():
    code = _START_AND_ANSWER % (COMPILER_MODULES,)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["compile"] == "off" and result["tokens"] == 4
    assert result["loaded"] == []
