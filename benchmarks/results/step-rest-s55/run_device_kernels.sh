#!/bin/bash
# The CPU kernels' tests on the lent machine's Intel CPU (AMX), and which of test_bad_shapes_raise's calls took the
# process down there (session 55's first call: a segmentation fault in it), each in a process of its own.
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LLMSERVE_KERNEL_CACHE=/tmp/kernels
g++ --version | head -1
python3 -c "import torch; print('torch', torch.__version__, 'cxx11 abi', torch._C._GLIBCXX_USE_CXX11_ABI)"
python3 -c 'from llmserve.kernels import load_cpu_kernels; print("kernels built", load_cpu_kernels())' 2>&1 | tail -1
echo "built at $((SECONDS - start)) s"
cat > /tmp/bad.py <<'PY'
import faulthandler, sys, torch
faulthandler.enable()
from llmserve.kernels import load_cpu_kernels
from llmserve.kernels.int8_gemm import pack_int8_for_amx
load_cpu_kernels()
which = int(sys.argv[1])
gen = torch.Generator().manual_seed(0)
q = torch.randint(-127, 128, (64, 128), generator=gen).to(torch.int8)
scales = torch.rand(64, generator=gen) * 0.01
x = torch.randn(4, 128, generator=gen)
xu, row_scales = torch.ops.llmserve.quantize_activations_u8(x, torch.ones(128))
packed, comp = pack_int8_for_amx(q)
gemm = torch.ops.llmserve.int8_gemm_portable
calls = [lambda: pack_int8_for_amx(torch.zeros(48, 64, dtype=torch.int8)),
         lambda: gemm(xu[:, :64].contiguous(), row_scales, packed, scales, comp, torch.float32),
         lambda: gemm(xu, row_scales[:2], packed, scales, comp, torch.float32),
         lambda: gemm(xu.to(torch.int8), row_scales, packed, scales, comp, torch.float32),
         lambda: torch.ops.llmserve.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5)]
try:
    calls[which]()
    print(which, "returned")
except Exception as e:
    print(which, "raised", type(e).__name__, str(e).splitlines()[0][:100])
PY
for i in 0 1 2 3 4; do timeout 60 python3 /tmp/bad.py $i 2>&1 | grep -v "^  File" | head -4; echo "rc $?"; done
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels --ignore=tests/kernels/test_decode_layer.py \
  --ignore=tests/kernels/test_grid_levels.py --deselect tests/kernels/test_int8_gemm.py::test_bad_shapes_raise 2>&1 \
  | grep -v "^  File\|^Extension" | tail -15
echo "done at $((SECONDS - start)) s"
