"""Test of the test: with griddepcontrol.wait cut out of a dependent kernel's source, the
test of its dependent launch must fail (exit 1).
  (default)  the certification kernel (the wide GEMM triggers at its start):
             tests/test_certify_gpu.py::test_dependent_launch_waits_for_the_gemm;
  --tail     the generated level kernels' wait cut, and the skinny GEMM's trigger moved
             from the end of its tile (skinny_finish) to its start, so a tail's blocks can
             run while the GEMM does (with the trigger at the end, launch latency alone
             covers the GEMM's last stores: the wait cut alone passed, twenty-second
             session): tests/test_split_rows.py::test_dependent_tail_waits_for_the_skinny_gemm;
  --tail-control  the trigger moved, the wait kept: must pass (exit 0).
Usage (GPU): PYTHONPATH=. python tools/mutant_pdl_wait.py [--tail | --tail-control]"""
import re
import sys

import pytest

from cupyfuse import runtime

_text, _source = runtime.expand_text, runtime.expand_source
CONTROL = "--tail-control" in sys.argv
TAIL = CONTROL or "--tail" in sys.argv
TRIGGER = 'asm volatile("griddepcontrol.launch_dependents;" ::: "memory");'


def _cut(source):
    text = _text(source)
    if TAIL:
        return text.replace("    cf_grid_dependency_wait();\n", "") \
            if "cf_tail_L" in text and not CONTROL else text
    return text.replace("    cf_grid_dependency_wait();\n", "", 1) if "cf_cert_row" in text else text


def _early(name, root=None):
    text = _source(name, root)
    if name != "gemm_skinny.cu":
        return text
    assert text.count(TRIGGER) == 1
    text = text.replace(TRIGGER, "")
    return re.sub(r"(int vec\) \{)", r"\1 " + TRIGGER, text)


runtime.expand_text = _cut
if TAIL:
    runtime.expand_source = _early
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-x",
                      "tests/test_split_rows.py::test_dependent_tail_waits_for_the_skinny_gemm"
                      if TAIL else
                      "tests/test_certify_gpu.py::test_dependent_launch_waits_for_the_gemm"]))
