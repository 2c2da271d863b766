"""Does a float32 product round a row the same whatever the call's row count? For MKL's `F.linear` and oneDNN's
packed product, the row counts (1-40, 63-65, 100, 255, 256, 512) whose rows differ in any bit from the same rows of
a 1000-row call, SmolLM2's and Qwen2.5-0.5B's shapes as (in, out) (session 59).

    .venv/bin/python benchmarks/results/float32-s59/row_counts.py
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (896, 1152), (896, 896), (896, 9728), (4864, 896),
          (576, 49152)]
COUNTS = [*range(1, 41), 63, 64, 65, 100, 255, 256, 512]


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for k, n in SHAPES:
        weight, bias = torch.randn(n, k), torch.randn(n)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        x = torch.randn(1000, k)
        products = {"MKL": lambda x, w=weight, b=bias: F.linear(x, w, b),
                    "oneDNN": lambda x, p=packed, b=bias: torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")}
        cells = []
        for name, product in products.items():
            whole = product(x)
            differ = [m for m in COUNTS if not torch.equal(product(x[:m]), whole[:m])]
            cells.append(f"{name}: {differ or 'none'}")
        print(f"{k} x {n}: row counts that round differently  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
