"""A corpus of Linear + tail models written the way people outside the team write them.

Each model is a class plus a ``make(cls=..., batch=...)`` that returns ``(model, inputs)``
at small CPU sizes: the class's own constructor (so ``make(cls=fused_class(Model))`` builds
the drop-in class with the same seed and the same parameters) and a tuple of example
inputs drawn from torch's global generator. Styles follow GitHub repositories, tutorials,
HF/timm heads, Kaggle notebooks and papers' reference code (``Case.style`` says which).
The models of ``mlp``, ``heads``, ``transformer``, ``pooling``, ``multihead``,
``rl_recsys``, ``science`` and ``out_of_scope`` are written as outside code is, without
regard to what cupyfuse fuses; ``idioms`` (small idioms from the wild: implicit-dim softmax,
in-place residuals, addmm alpha/beta, tied weights, pooling options, cosine similarity,
batch-dim statistics) is chosen to look for wrong answers, not to convert. None is adapted
to cupyfuse (one reference detail: ``TimestepEmbedding`` builds its frequencies in t's
dtype, so that the float64 reference runs).

Every model is registered with :func:`case`, which records what is expected of it
(``CONVERTS``: fused and equal to the float64 eager model at atol = rtol = 1e-4;
``REFUSED``: a ``cupyfuse.TailError`` naming an op and a source line), per mode where
train and eval differ, and, for a known problem, an ``xfail`` reason (kept strict, so a
fix shows up). ``tests/corpus/test_outside_corpus.py`` checks every expectation,
``tests/corpus/test_outside_corpus_gpu.py`` runs the converting ones on CUDA and
``tools/outside_survey.py`` prints the table.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

CONVERTS = "converts"
REFUSED = "refused"
BOTH = ("eval", "train")
EVAL = ("eval",)           # train mode draws random numbers (active dropout, sampling)

# known problems are strict xfails (Case.xfail: a reason, or one per mode; a fix shows up
# as XPASS and the expectation is updated); no case carries one


@dataclass
class Case:
    name: str
    cls: type
    make: Callable[..., tuple]
    module: str
    expect: Any = None                 # CONVERTS / REFUSED, or {mode: CONVERTS/REFUSED}
    modes: tuple = BOTH
    style: str = ""                    # where the style comes from
    xfail: Any = None                  # reason (str) or {mode: reason}: a wrong answer
    batches: tuple = (1, 5)
    nonfinite: bool = True             # a NaN/inf input row is meaningful for this model
    notes: str = ""
    # the devices whose NaN/inf check runs (a reason in ``notes`` where one is left out:
    # torch's own float32 kernels disagree there)
    nonfinite_devices: tuple = ("cpu", "cuda")

    def expected(self, mode: str) -> str | None:
        if isinstance(self.expect, dict):
            return self.expect.get(mode)
        return self.expect

    def xfail_reason(self, mode: str) -> str | None:
        if isinstance(self.xfail, dict):
            return self.xfail.get(mode)
        return self.xfail


CASES: list[Case] = []
MODULES = ("mlp", "heads", "transformer", "pooling", "multihead", "rl_recsys", "science", "idioms",
           "out_of_scope")


def case(cls: type, expect: Any = None, **kw: Any) -> Callable:
    """Register ``make`` (decorated) for model class ``cls``."""
    def deco(make: Callable) -> Callable:
        name = kw.pop("name", None) or cls.__name__
        assert all(c.name != name for c in CASES), f"duplicate case {name}"
        CASES.append(Case(name=name, cls=cls, make=make, module=make.__module__.split(".")[-1],
                          expect=expect, **kw))
        return make
    return deco


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape) * scale


def token_mask(batch: int, seq: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """An attention mask as tokenizers give it: 1 for tokens, 0 for right padding; every
    row keeps at least its first token."""
    lens = torch.randint(1, seq + 1, (batch,))
    m = (torch.arange(seq)[None, :] < lens[:, None])
    return m.to(dtype)


def all_cases() -> list[Case]:
    for mod in MODULES:
        importlib.import_module(f"{__name__}.{mod}")
    return CASES
