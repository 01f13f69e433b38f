"""Test of the test: tests/test_certify_gpu.py::test_dependent_launch_waits_for_the_gemm
with the certification kernel's griddepcontrol.wait cut out of its source: it must fail (exit 1).
Usage (GPU): PYTHONPATH=. python tools/mutant_pdl_wait.py"""
import sys

import pytest

from cupyfuse import runtime

_orig = runtime.expand_text


def _cut(source):
    text = _orig(source)
    return text.replace("    cf_grid_dependency_wait();\n", "", 1) if "cf_cert_row" in text else text


runtime.expand_text = _cut
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-x",
                      "tests/test_certify_gpu.py::test_dependent_launch_waits_for_the_gemm"]))
