"""How much of each fused op's benchmark time is host overhead: do_bench (median, L2 flush
as in the bench) of fused(x) eagerly, and of a CUDA-graph replay of the same call (+ a
clone of the output, as a graph cache would need). Usage: PYTHONPATH=. python tools/graph_gap.py"""
import torch
from triton.testing import do_bench

from cupyfuse import models
from cupyfuse import nn as cnn

for key in ["55", "56", "98", "39"]:
    torch.manual_seed(0)
    model = models.make_model(key, device="cuda")
    fused = cnn.from_model(model)
    x = models.get_inputs(key, device="cuda")[0]
    with torch.no_grad():
        for _ in range(3):
            fused(x)
        torch.cuda.synchronize()
        eager = do_bench(lambda: fused(x), warmup=50, rep=300, return_mode="median")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = fused(x)
        replay = do_bench(lambda: g.replay(), warmup=50, rep=300, return_mode="median")
        replay_clone = do_bench(lambda: (g.replay(), static.clone()), warmup=50, rep=300,
                                return_mode="median")
    print(f"{key}: eager {eager:.3f} ms | graph replay {replay:.3f} | replay + clone "
          f"{replay_clone:.3f}")
    del model, fused, x, g, static
    torch.cuda.empty_cache()
