"""GPU smoke check of generated tails: a few models vs float64 on the CPU (device runs)."""
import copy
import torch, torch.nn as nn, torch.nn.functional as F
import cupyfuse

torch.manual_seed(0)


class M(nn.Module):
    def __init__(s, i, o):
        super().__init__(); s.l = nn.Linear(i, o); s.bn = nn.BatchNorm1d(o); s.p = nn.Parameter(torch.randn(o))
        s.gn = nn.GroupNorm(4, o); s.l2 = nn.Linear(o // 2, 40)

    def forward(s, x):
        y = s.bn(s.l(x)) * s.p
        y = s.gn(y)
        y = F.max_pool1d(y.unsqueeze(1), 2).squeeze(1)
        y = torch.softmax(F.leaky_relu(y, 0.2), dim=1)
        y = s.l2(y)
        return F.gelu(y) + torch.logsumexp(y, dim=1, keepdim=True)


for (B, K, N) in [(5, 64, 256), (33, 100, 132), (1024, 512, 1024)]:
    m = M(K, N)
    ref = copy.deepcopy(m).double()
    fm = cupyfuse.fused_class(M)
    f = cupyfuse.from_model(copy.deepcopy(m).cuda())
    x = torch.randn(B, K) * 2
    if B > 1:
        x[1, 3] = float("nan")
    out = f(x.cuda()).cpu().double()
    r = ref(x.double())
    ok = torch.allclose(out, r, atol=1e-4, rtol=1e-4, equal_nan=True)
    print(f"model B={B} K={K} N={N}: ok={ok} maxerr={(out - r).nan_to_num().abs().max():.2e}")
    rm = (f.model.bn.running_mean.cpu().double() - ref.bn.running_mean).abs().max()
    print(f"  running_mean diff {rm:.2e}, nbt {int(f.model.bn.num_batches_tracked)}")

x = torch.randn(64, 96).cuda(); w = torch.randn(200, 96).cuda(); b = torch.randn(200).cuda()
t = cupyfuse.CudaTail(map="h * h", reduce="a + b", identity="0", post="sqrt(r)", acc="double")
o = cupyfuse.fused_linear(x, w, b, t)
r = ((x.double() @ w.double().t() + b.double()) ** 2).sum(1, keepdim=True).sqrt()
print("CudaTail norm ok", torch.allclose(o.double(), r, atol=1e-4, rtol=1e-4))
import cupy
xc, wc, bc = cupy.asarray(x), cupy.asarray(w), cupy.asarray(b)
o = cupyfuse.fused_linear(xc, wc, bc, lambda h: torch.softmax(h, dim=1))
print("cupy operands ->", type(o).__name__, torch.allclose(torch.from_dlpack(o).double(), torch.softmax(x.double() @ w.double().t() + b.double(), 1), atol=1e-4, rtol=1e-4))
