"""Ready plans (cupyfuse/backend/prepared.py ``_Launch``) launch from a parameter buffer per
thread, packed once, where a call writes only its operands' and result's addresses. Two
threads calling the same plan must not see each other's addresses: here thread A is held
between writing its addresses and its launch until thread B's whole call has run (the
interleaving a shared buffer would get wrong), on the CPU with the launches emulated
(tests/emu/prepared.py)."""
from __future__ import annotations

import threading

import torch

from cupyfuse import runner
from cupyfuse.backend import prepared

from emu import prepared as _prepemu


def _tail(h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(h).sum(dim=1, keepdim=True)


def test_two_threads_one_ready_plan(monkeypatch) -> None:
    torch.manual_seed(0)
    xa, xb = torch.randn(5, 24), torch.randn(5, 24) * 3
    w, b = torch.randn(40, 24) * 0.2, torch.randn(40)
    prog = runner._function_program(_tail, xa, 40, True, [])
    _prepemu.install(monkeypatch)
    pr = _prepemu.prepare(_prepemu.runnable(prog), [xa], [w, b])
    assert pr is not None
    first = _prepemu.call(pr, [xa], [w, b])
    assert pr._ready, "no ready plan after the first call"

    emulate = prepared._launch_kernel
    b_done = threading.Event()
    a_waiting = threading.Event()

    def launch(*args):
        if threading.current_thread().name == "A":
            a_waiting.set()
            assert b_done.wait(30), "thread B did not finish"
        emulate(*args)

    monkeypatch.setattr(prepared, "_launch_kernel", launch)
    got = {}

    def run(name, x):
        got[name] = _prepemu.call(pr, [x], [w, b])
        if name == "B":
            b_done.set()

    ta = threading.Thread(target=run, args=("A", xa), name="A")
    ta.start()
    assert a_waiting.wait(30)
    tb = threading.Thread(target=run, args=("B", xb), name="B")
    tb.start()
    tb.join(30)
    ta.join(30)
    ref = lambda x: torch.sigmoid(x.double() @ w.double().t() + b.double()).sum(1, keepdim=True)
    torch.testing.assert_close(got["A"].double(), ref(xa), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["B"].double(), ref(xb), atol=1e-4, rtol=1e-4)
    assert torch.equal(got["A"], first)
