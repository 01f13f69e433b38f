"""Where the certification kernel's time goes (model 98's shapes): the generated kernel
and variants of its source with a phase cut out, each timed alone after the one-pass
GEMM (L2 flushed before the GEMM, CUDA events around the kernel, median of 20). The cut
variants compute wrong values: timing only. Usage: PYTHONPATH=. python
tools/certify_phases.py [VARIANT ...] (default: all)"""
import statistics
import sys

import cupy
import torch

import cupyfuse
from cupyfuse import certify, engine, models, rewrite, runtime

torch.manual_seed(0)
model = models.make_model("98", device="cuda")
x = models.get_inputs("98", device="cuda")[0]
M2 = type("M2", (type(model),), {})   # a subclass: the generic FusedModel, whose program we read
m2 = M2.__new__(M2)
m2.__dict__ = model.__dict__
prog = rewrite.rewrite(cupyfuse.from_model(m2).program(x[:4]))
g = next(i for i, n in enumerate(prog.nodes) if n.kind == "gemm")
chain = certify.find(prog, g)
w0 = model.matmul.weight.detach()
kwin, kst = prog.nodes[g].attrs[2][1:3]
wf, bf, fa, fc, wmax = rewrite.fold_coefficients(prog, g, model.matmul.weight.detach(),
                                               [model.matmul.weight.detach(),
                                                model.matmul.bias.detach()])
M, K = x.shape
N = wf.shape[0]
wn, wu, wmap, _ = certify.weight_data(wf)
h = torch.empty(M, N, device="cuda")
counts = torch.empty(M, dtype=torch.int32, device="cuda")
name, src, params = certify.source(prog, chain)
assert not params, "the launch below passes no chain parameters (98's chain has none)"
text = runtime.expand_text(src)
# x's pass (the norms), and the same cut out
XLOOP = "for (int q = tid; q < (K >> 2); q += CF_CERT_THREADS) {\n            // staged: read once"
XNONE = "for (int q = tid; q < 0; q += CF_CERT_THREADS) {\n            // staged: read once"
CUTS = {
    "full": [],
    "batch 1": [("#define CF_CERT_THREADS", "#define CF_CERT_BATCH 1\n#define CF_CERT_THREADS")],
    "batch 2": [("#define CF_CERT_THREADS", "#define CF_CERT_BATCH 2\n#define CF_CERT_THREADS")],
    "no candidates": [("if (!ok || !(hi < L - margin))", "if (false)")],
    "zhat + ranges": [("if (!ok || !(hi < L - margin))", "if (false)"),
                      (XLOOP,
                       XNONE)],
    "zhat + trivial ranges": [("if (!ok || !(hi < L - margin))", "if (false)"),
                              ("return chain(n, lo, hi, mag);", "return true;"),
                              (XLOOP,
                               XNONE)],
    "ranges, no zhat": [("if (!ok || !(hi < L - margin))", "if (false)"),
                        ("const float z = cf_cert_zhat(pr, splits, sstride, n);",
                         "const float z = 1e-3f * (float)n;"),
                        (XLOOP,
                         XNONE)],
    "empty blocks": [("const bool xs_on = staged & 1", "if (tid >= 0) return;\n    const bool xs_on = staged & 1")],
    "no norms": [(XLOOP,
                  XNONE)],
}
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
nbytes, staged = certify.smem(K, N)
ONLY = sys.argv[1:]   # variant names: only these (for Nsight Compute)
for label, cuts in CUTS.items():
    if ONLY and label not in ONLY:
        continue
    t = text
    for a, b in cuts:
        assert a in t, (label, a)
        t = t.replace(a, b, 1)
    fn = cupy.RawModule(code=t, options=("-std=c++17", f"-arch={runtime.arch_for_device(0)}")).get_function(name)
    fn.max_dynamic_shared_size_bytes = nbytes
    threads = int(t.split("#define CF_CERT_THREADS ")[1].split()[0])
    ts = []
    for _ in range(23):
        flush.zero_()
        P, splits, sstride, ldp = engine.gemm_wide_parts(x, wf, h, b_maps=wmap)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn((M,), (threads,),
           (x.data_ptr(), cupy.int64(K), cupy.int32(K), cupy.int32(1), wf.data_ptr(),
            cupy.int64(K), wn.data_ptr(), wu.data_ptr(), cupy.float64(certify.gamma(K, splits)),
            cupy.float64(wmax), bf.data_ptr(), P.data_ptr(), cupy.int32(splits),
            cupy.int64(sstride), cupy.int64(ldp), h.data_ptr(), cupy.int64(N), cupy.int32(N),
            counts.data_ptr(), cupy.int32(staged), w0.data_ptr(), cupy.int64(w0.stride(0)),
            cupy.int64(w0.stride(1)), fa.data_ptr(), fc.data_ptr(), cupy.int32(kwin),
            cupy.int32(kst), cupy.uint64(0)),   # red_out: none (h written in full)
           shared_mem=nbytes, stream=cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    c = counts.float()
    print(f"{label:26s} {statistics.median(ts[3:]):6.1f} us  candidates/row {float(c.mean()):.2f}",
          flush=True)
