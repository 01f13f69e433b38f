"""When specialised calls are built (runner._specialise_fn, _Runner._specialise), on the
CPU with the builders replaced by recorders: the second hit in a row of the same entry
builds one, per tail object (a forward calling two fused tails in turn gets both), once
per ready plan; alternating entries of one tail build none; a new ready plan rebuilds."""
from __future__ import annotations

from types import SimpleNamespace
from cupyfuse import runner



def _ent(launches):
    return (SimpleNamespace(_ready={(7, False): (None, None, (), (), launches)}), [])


def test_tail_rules(monkeypatch):
    built = []
    monkeypatch.setattr(runner._fastpath, "build_function",
                        lambda tail, *a: built.append(tail) or (lambda *b: None))
    monkeypatch.setattr(runner, "_fn_specs", {})
    monkeypatch.setattr(runner, "_fn_spec_state", {})
    monkeypatch.setattr(runner, "_fn_last", {})

    def ta(h):
        return h

    def tb(h):
        return h

    ea, eb = _ent(["la"]), _ent(["lb"])
    hit = lambda tail, key, ent: runner._specialise_fn(tail, key, ent, None, None, None, 0, 7,
                                                      None)
    # two tails called in turn, each with its own entry: both built at their second hit
    for _ in range(2):
        hit(ta, ("a",), ea)
        hit(tb, ("b",), eb)
    assert built == [ta, tb]
    # more hits of the same plans: not rebuilt
    for _ in range(3):
        hit(ta, ("a",), ea)
        hit(tb, ("b",), eb)
    assert built == [ta, tb]
    # one tail alternating two entries: nothing built for either
    built.clear()
    ea2 = _ent(["la2"])
    for _ in range(3):
        hit(ta, ("a2",), ea2)
        hit(ta, ("a",), ea)
    assert built == []
    # a new ready plan for the same entry (the weight changed): rebuilt at its second hit
    ea3 = _ent(["la3"])
    hit(ta, ("a",), ea3)
    hit(ta, ("a",), ea3)
    assert built == [ta]
    # no ready plan: nothing
    built.clear()
    none = (SimpleNamespace(_ready={}), [])
    hit(tb, ("c",), none)
    hit(tb, ("c",), none)
    assert built == []


def test_module_runner_rules(monkeypatch):
    built = []
    monkeypatch.setattr(runner._fastpath, "build",
                        lambda runner, outer, *a: built.append(outer) or (lambda *b: None))
    r = runner._Runner(lambda m, c: None)
    outer = object()
    r.outer = lambda: outer   # (a weak reference's call)
    e1, e2 = _ent(["l1"]), _ent(["l2"])
    hit = lambda key, ent: r._specialise(None, (), key, ent, 0, 7, None)
    hit(("k1",), e1)
    assert built == [] and r._spec is None
    hit(("k1",), e1)
    assert built == [outer] and r._spec is not None
    hit(("k1",), e1)
    assert built == [outer]
    for _ in range(2):   # alternating entries: not rebuilt
        hit(("k2",), e2)
        hit(("k1",), e1)
    assert built == [outer]
    hit(("k2",), e2)
    hit(("k2",), e2)
    assert built == [outer, outer]
    # a FusedModel that is gone (its weak reference dead): nothing built
    r2 = runner._Runner(lambda m, c: None)
    r2.outer = lambda: None
    r2._specialise(None, (), ("k",), e1, 0, 7, None)
    r2._specialise(None, (), ("k",), e1, 0, 7, None)
    assert r2._spec is None and len(built) == 2
