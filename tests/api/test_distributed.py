"""torch.distributed on the CPU (gloo), 2 and 4 processes: a fused module trains under DDP
and FSDP2 exactly as the original does (parameters after SGD steps), and the
vocabulary-sharded linear_cross_entropy and cupyfuse.parallel.sharded_linear (softmax,
log_softmax, logsumexp over features sharded by rows of the weight) give every rank the
unsharded results and gradients (float64 reference within 1e-4; the same bits on every
rank and run to run; NaN and all -inf rows where torch puts them)."""
from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        return torch.log_softmax(self.out(self.ln(F.gelu(self.fc(x)))), -1)


def _wrapped_training(rank: int, world: int, how: str) -> None:
    import cupyfuse

    torch.manual_seed(0)
    ref = Head()
    fm = cupyfuse.from_model(copy.deepcopy(ref))
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        R, M = DDP(ref), DDP(fm)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(ref, mesh=mesh)
        fully_shard(fm, mesh=mesh)
        R, M = ref, fm
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, fm)]
    g = torch.Generator().manual_seed(100 + rank)   # each rank its own batch
    for _ in range(3):
        x, c = torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)
        for mod, opt in zip((R, M), opts):
            opt.zero_grad()
            (mod(x) * c).sum().backward()
            opt.step()
    for (name, a), (_, b) in zip(ref.named_parameters(), fm.named_parameters()):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (how, name, (a - b).abs().max())
    # the steps did something: the fused module's parameters left their init
    torch.manual_seed(0)
    init = Head()
    assert any(not torch.allclose(p.full_tensor() if hasattr(p, "full_tensor") else p, q)
               for p, q in zip(fm.parameters(), init.parameters()))


def _check_sharded(x, W, b, rows, reference, sharded, sliced: bool) -> tuple:
    """``sharded(x, W[rows], b[rows])`` against ``reference(x, W, b)`` in float64 (this
    rank's columns of it where ``sliced``): the result and the gradients of x, W's and b's
    rows within 1e-4, the same bits twice. Returns (result, dx)."""
    xr, Wr, br = (t.double().requires_grad_() for t in (x, W, b))
    ref = reference(xr, Wr, br)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gx, gW, gb = torch.autograd.grad(ref, (xr, Wr, br), cot)
    want, c = (ref[:, rows], cot[:, rows]) if sliced else (ref, cot)
    runs = []
    for _ in range(2):
        xs = x.clone().requires_grad_()
        Ws, bs = W[rows].clone().requires_grad_(), b[rows].clone().requires_grad_()
        out = sharded(xs, Ws, bs)
        out.backward(c.float())
        runs.append((out.detach(), xs.grad, Ws.grad, bs.grad))
    assert all(torch.equal(p, q) for p, q in zip(*runs)), "not the same bits run to run"
    out, dx, dW, db = runs[0]
    for got, exp in ((out, want), (dx, gx), (dW, gW[rows]), (db, gb[rows])):
        assert torch.allclose(got.double(), exp, atol=1e-4, rtol=1e-4), (got.double() - exp).abs().max()
    return out, dx


def _operands(T: int, H: int, N: int, seed: int, scale: float) -> tuple:
    """x (T, H), W (N, H) * scale, b (N,) and the generator, for the rest of a case."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g), torch.randn(N, H, generator=g) * scale,
            torch.randn(N, generator=g), g)


def _sharded_cross_entropy(rank: int, world: int) -> None:
    from cupyfuse import lmhead

    T, H, V = 13, 12, 37                       # 37 classes: uneven shards
    x, W, b, g = _operands(T, H, V, 0, 0.3)
    y = torch.randint(0, V, (T,), generator=g)
    y[::4] = -100
    cw = torch.rand(V, generator=g) + 0.5
    rows = torch.tensor_split(torch.arange(V), world)[rank]
    for ls, red in ((0.0, "mean"), (0.2, "sum"), (0.1, "none")):
        loss, dx = _check_sharded(
            x, W, b, rows,
            lambda a, w, c: F.cross_entropy(F.linear(a, w, c), y, weight=cw.double(),
                                            label_smoothing=ls, reduction=red),
            lambda a, w, c: lmhead.linear_cross_entropy(a, w, y, c, class_weight=cw,
                                                        label_smoothing=ls, reduction=red,
                                                        chunk_rows=8,
                                                        process_group=dist.group.WORLD),
            sliced=False)
        # every rank holds the same loss and dx bits
        both = torch.cat([loss.reshape(-1), dx.reshape(-1)])
        parts = [torch.empty_like(both) for _ in range(world)]
        dist.all_gather(parts, both)
        assert all(torch.equal(p, parts[0]) for p in parts)


def _sharded_tails(rank: int, world: int) -> None:
    from cupyfuse.parallel import sharded_linear

    T, H, N = 9, 10, 23                                  # 23 features: uneven shards
    x, W, b, _ = _operands(T, H, N, 3, 0.5)
    rows = torch.tensor_split(torch.arange(N), world)[rank]
    fns = {"softmax": torch.softmax, "log_softmax": torch.log_softmax,
           "logsumexp": torch.logsumexp,
           "layer_norm": lambda h, d: F.layer_norm(h, h.shape[-1:], eps=1e-5)}
    for tail, fn in fns.items():
        _check_sharded(x, W, b, rows, lambda a, w, c: fn(F.linear(a, w, c), -1),
                       lambda a, w, c: sharded_linear(a, w, c, tail), sliced=tail != "logsumexp")
    # the norm of rows far from 0 (a sum of squares would cancel; merged moments do not)
    far = b + 300.0
    got = sharded_linear(x, W[rows], far[rows], "layer_norm")
    want = F.layer_norm(F.linear(x.double(), W.double(), far.double()), (N,), eps=1e-5)[:, rows]
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), (got.double() - want).abs().max()
    # a NaN row and an all -inf row come out where torch puts them
    xn = x.clone()
    xn[2] = float("nan")
    bn = b.clone()
    Wn = W.clone()
    Wn[:] = 0.0
    bn[:] = -float("inf")
    for tail, fn in fns.items():
        for xx, WW, bb in ((xn, W, b), (x, Wn, bn)) if tail != "layer_norm" else ((xn, W, b),):
            got = sharded_linear(xx, WW[rows], bb[rows], tail)
            want = fn(F.linear(xx.double(), WW.double(), bb.double()), -1)
            want = want if tail == "logsumexp" else want[:, rows]
            assert torch.equal(torch.isnan(got), torch.isnan(want)), (tail, got, want)
            assert torch.allclose(got.double(), want, atol=1e-4, equal_nan=True), (tail, got, want)


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _sharded_cross_entropy(rank, world)
        _sharded_tails(rank, world)
        _wrapped_training(rank, world, "ddp")
        _wrapped_training(rank, world, "fsdp2")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_fsdp2_and_the_sharded_loss(world: int) -> None:
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)
