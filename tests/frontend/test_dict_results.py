"""A forward returning a dict, called with NumPy operands: each result comes back as a
NumPy array under its key (runner._results converts dicts as well as tuples and lists;
a dict left unconverted raises an AttributeError)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

import cupyfuse


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x)
        return {"logits": h, "probs": torch.softmax(h, dim=1)}


def test_dict_results_with_numpy_operands() -> None:
    torch.manual_seed(0)
    m = DictHead().eval()
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    with torch.no_grad():
        want = m.double()(torch.from_numpy(x).double())
        m.float()
        for fm in (cupyfuse.from_model(m), cupyfuse.fused_class(DictHead)()):
            if not isinstance(fm, type(None)):
                fm.load_state_dict(m.state_dict())
            got = fm(x)
            assert type(got) is dict and list(got) == ["logits", "probs"]
            for k in got:
                assert isinstance(got[k], np.ndarray), (k, type(got[k]))
                np.testing.assert_allclose(got[k], want[k].numpy(), atol=1e-4, rtol=1e-4)
