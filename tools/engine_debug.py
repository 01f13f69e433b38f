"""One small sm90 GEMM with diagnostics (attributes, errors), for compute-sanitizer."""
import torch

from cupyfuse import engine
from cupyfuse.interop import _external_stream
from cupyfuse.runtime import get_function

import cupy  # noqa: E402

cupy.cuda.Device(0).use()
_external_stream(torch.cuda.current_stream().cuda_stream, 0).__enter__()
M = N = 64
K = 32
a = torch.randn(M, K, device="cuda")
b = torch.randn(N, K, device="cuda")
out = torch.full((M, N), float("nan"), device="cuda")
engine.gemm(a, b, out, passes=1, splits=1)
torch.cuda.synchronize()
import math  # noqa: E402
from cupyfuse.runtime import launch  # noqa: E402

dbg = get_function("gemm_sm90.cu", "gemm_sm90_tf32", 0, ("-DCF_GEMM_DEBUG",))
ta = engine.encode_tensor_map(a)
tb = engine.encode_tensor_map(b)
launch(dbg, 1, 384, "128s128s128s128sPiiiqiq", (ta, tb, ta, tb, out.data_ptr(), M, N, K, N, 1, 0),
       shared_mem=engine.SMEM_BYTES[1])
torch.cuda.synchronize()
print("after debug launch: nan left", int(torch.isnan(out).sum()))
fn = get_function("gemm_sm90.cu", "gemm_sm90_tf32", 0)
r = fn.raw
print("regs", r.num_regs, "maxthreads", r.max_threads_per_block, "dyn smem", r.max_dynamic_shared_size_bytes,
      "static smem", r.shared_size_bytes, "local", r.local_size_bytes, "ptx", r.ptx_version, "bin", r.binary_version)
print("nan left", int(torch.isnan(out).sum()), "err", (out - a @ b.T).abs().max().item())
