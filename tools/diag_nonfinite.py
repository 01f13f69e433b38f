"""Diagnose a GPU non-finite fuzz mismatch: PyTorch float32 on CPU vs on CUDA vs cupyfuse."""
import sys

import torch

sys.path.insert(0, "tests")
from test_fuzz_gpu import GPU_NF_CASES  # noqa: E402
from test_fuzz_cpu import build_nonfinite, run_fused, as_torch  # noqa: E402
from cupyfuse import nn as cfnn  # noqa: E402

want = sys.argv[1] if len(sys.argv) > 1 else "98-11"
for case in GPU_NF_CASES:
    if not case.id.startswith(want):
        continue
    model, x = build_nonfinite(case, "cuda")
    with torch.no_grad():
        gpu32 = model(x).cpu()
        cpu32 = model.cpu()(x.cpu())
        model.cuda()
        ours = as_torch(run_fused(cfnn.from_model(model), x)).cpu()
    print(case.id)
    print(" x nonfinite:", torch.nonzero(~torch.isfinite(x.cpu())).tolist())
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][0]
    print(" bias:", lin.bias.detach().cpu().tolist())
    print(" torch cuda fp32:", gpu32.tolist())
    print(" torch cpu  fp32:", cpu32.tolist())
    print(" cupyfuse       :", ours.tolist())
