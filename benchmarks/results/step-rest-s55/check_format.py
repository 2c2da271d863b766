"""Whether a TORCH_CHECK whose message formats an integer raises or crashes in a plain extension (no llmserve code),
built the way llmserve's kernels are, and which libstdc++ the process loaded (the lent machine's image)."""
import torch
from torch.utils import cpp_extension

source = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor check_text(const at::Tensor& x) { TORCH_CHECK(false, "text only: ", "no number"); return x; }
at::Tensor check_number(const at::Tensor& x) { TORCH_CHECK(false, "a number: ", x.size(0)); return x; }
TORCH_LIBRARY(formatcheck, m) {
  m.def("check_text(Tensor x) -> Tensor", &check_text);
  m.def("check_number(Tensor x) -> Tensor", &check_number);
}
"""
for flags in (["-O3"], ["-O3", "-march=native", "-ffast-math", "-fopenmp"]):
    name = "formatcheck" + str(len(flags))
    cpp_extension.load_inline(name, [source.replace("formatcheck", name)], extra_cflags=flags,
                              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    for op in ("check_text", "check_number"):
        try:
            getattr(getattr(torch.ops, name), op)(torch.zeros(3))
        except RuntimeError as e:
            print(flags, op, "raised:", str(e).splitlines()[0], flush=True)
print([line.split()[-1] for line in open("/proc/self/maps") if "libstdc++" in line][:1])
