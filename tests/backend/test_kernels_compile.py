"""kernels_cu compiles for Hopper without spills or stack frames, the kernels the ops
launch exist, and runtime.expand_source expands includes faithfully."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cupyfuse.backend import runtime
from conftest import REPO_ROOT

KDIR = REPO_ROOT / "kernels_cu"
CU_FILES = sorted(p.name for p in KDIR.glob("*.cu"))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS_RE = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                       r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_GLOBAL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?'
                        r'(\w+)\s*\(')
_MACRO_DEF_RE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\((\w+)[^)]*\)((?:[^\n]*\\\n)*[^\n]*)",
                           re.M)


def _hopper_only(name: str) -> bool:
    """Sources named *_sm90*.cu use wgmma/TMA/setmaxnreg: they exist for sm_90a alone."""
    return "_sm90" in name


def _kernels_declared(name: str) -> set[str]:
    """extern "C" kernels of a source: declared directly, or through a macro whose body
    declares a __global__ function named by its first parameter."""
    text = (KDIR / name).read_text()
    # macro bodies (lines continued with a backslash) declare no kernel by themselves
    plain = "\n".join(ln for ln in text.splitlines() if not ln.rstrip().endswith("\\"))
    found = set(_GLOBAL_RE.findall(plain))
    for macro, param, body in _MACRO_DEF_RE.findall(text):
        if "__global__" in body and re.search(rf"\b{param}\s*\(", body):
            found |= set(re.findall(rf"^\s*{macro}\(\s*(\w+)\s*,", text, re.M))
    return found


def _nvcc(src: Path, out: Path, *extra: str, arch: str = "sm_90a") -> subprocess.CompletedProcess:
    compute = arch.replace("sm_", "compute_")
    cmd = [NVCC, "-cubin", "-o", str(out), "-std=c++17", *extra,
           f"-gencode=arch={compute},code={arch}", "-Xptxas", "-v", str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Compile every kernels_cu/*.cu once per architecture, in parallel."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    tmp = tmp_path_factory.mktemp("cubin")
    procs = {}
    for arch in ("sm_90a", "sm_80"):
        for name in CU_FILES:
            if arch == "sm_80" and _hopper_only(name):
                continue
            compute = arch.replace("sm_", "compute_")
            cmd = [NVCC, "-cubin", "-o", str(tmp / f"{name}.{arch}.cubin"), "-std=c++17",
                   "-I", str(KDIR), f"-gencode=arch={compute},code={arch}", "-Xptxas", "-v",
                   str(KDIR / name)]
            procs[(name, arch)] = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                         stderr=subprocess.PIPE, text=True))
    out = {}
    for key, (cmd, p) in procs.items():
        so, se = p.communicate(timeout=300)
        out[key] = subprocess.CompletedProcess(cmd, p.returncode, so, se)
    return out


def test_there_are_kernels() -> None:
    assert CU_FILES, f"no .cu files in {KDIR}"


@needs_nvcc
@pytest.mark.parametrize("arch", ("sm_90a", "sm_80"))
@pytest.mark.parametrize("name", CU_FILES)
def test_nvcc_compiles_without_spills(name: str, arch: str, ptxas_reports: dict) -> None:
    if arch == "sm_80" and _hopper_only(name):
        pytest.skip(f"{name} is Hopper-only (wgmma, TMA, setmaxnreg): built for sm_90a only")
    res = ptxas_reports[(name, arch)]
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(res.args)}\n{log}"
    assert "warning" not in log.lower(), log
    entries = {n for n, _ in _ENTRY_RE.findall(log)}
    declared = _kernels_declared(name)
    assert declared and declared <= entries, f"kernels {declared - entries} missing from ptxas output"
    props = _PROPS_RE.findall(log)
    assert {p[0] for p in props} >= declared, log
    for fn, stack, spill_st, spill_ld in props:
        assert int(spill_st) == 0 and int(spill_ld) == 0, (
            f"{name}:{fn} spills ({spill_st} bytes stores, {spill_ld} bytes loads) on {arch}")
        assert int(stack) == 0, f"{name}:{fn} has a {stack}-byte stack frame on {arch}"


# the modules that launch kernels (prepared.py: through _Step(get_function(...), grid,
# block, template, ...), the same argument order as launch)
LAUNCHING_FILES = tuple(sorted(str(p.relative_to(REPO_ROOT / "cupyfuse"))
                              for p in (REPO_ROOT / "cupyfuse").rglob("*.py")
                              if "get_function(" in p.read_text()))


def _launched_kernels() -> set[tuple[str, str]]:
    """(source, kernel) pairs the ops launch, read from LAUNCHING_FILES: direct
    get_function("x.cu", "name") calls, and names passed around as string literals that
    start with a source's stem (gemm_sm90.cu -> "gemm_sm90_...")."""
    text = "\n".join((REPO_ROOT / "cupyfuse" / f).read_text() for f in LAUNCHING_FILES)
    pairs = set(re.findall(r'get_function\(\s*"(\w+\.cu)"\s*,\s*"(\w+)"', text))
    literals = set(re.findall(r'"([a-z_][a-z0-9_]*)"', text))
    for lit in literals:
        # the source with the longest stem the literal starts with (gemm_sm90_wide_bf16
        # belongs to gemm_sm90_wide.cu, not gemm_sm90.cu)
        owners = [src for src in CU_FILES if lit.startswith(src[:-3] + "_")]
        if owners:
            pairs.add((max(owners, key=len), lit))
    return pairs


def test_every_launched_kernel_exists() -> None:
    pairs = _launched_kernels()
    assert len(pairs) >= 6, pairs
    assert {src for src, _ in pairs} == set(CU_FILES), "a kernels_cu source is never launched"
    for src, fn in sorted(pairs):
        assert (KDIR / src).is_file(), f"ops.py launches from missing kernels_cu/{src}"
        assert fn in _kernels_declared(src), f"ops.py launches {fn}, not defined in {src}"


@needs_nvcc
def test_launched_kernels_are_compiled_entries(ptxas_reports: dict) -> None:
    """Cross-check with the compiler's own list of entry functions."""
    for src, fn in sorted(_launched_kernels()):
        res = ptxas_reports[(src, "sm_90a")]
        entries = {n for n, _ in _ENTRY_RE.findall(res.stdout + res.stderr)}
        assert fn in entries, f"{fn} is not an entry function of {src}: {sorted(entries)}"


# ---------------------------------------------------------------------------------
# Launch argument formats (runtime.launch packs arguments with the struct codes that
# runtime.kernel_formats reads from each kernel's signature)
# ---------------------------------------------------------------------------------
def _split_params(text: str) -> list[str]:
    text = text.replace("\\\n", " ").strip()
    return [p.strip() for p in text.split(",") if p.strip()] if text else []


def _params_after(text: str, pos: int) -> str:
    """Text between the '(' at or after ``pos`` and its matching ')'."""
    start = text.index("(", pos)
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    raise AssertionError("unbalanced parentheses")


def _kernel_params(name: str) -> dict[str, list[str]]:
    """Parameter declarations of every extern "C" kernel of a source."""
    text = (KDIR / name).read_text()
    out: dict[str, list[str]] = {}
    plain = "\n".join(ln for ln in text.splitlines() if not ln.rstrip().endswith("\\"))
    for m in _GLOBAL_RE.finditer(plain):
        out[m.group(1)] = _split_params(_params_after(plain, m.end() - 1))
    for macro, param, body in _MACRO_DEF_RE.findall(text):
        body = body.replace("\\\n", " ")
        m = re.search(rf"__global__.*?\b{param}\s*\(", body)
        if not m:
            continue
        params = _split_params(_params_after(body, m.end() - 1))
        for kname in re.findall(rf"^\s*{macro}\(\s*(\w+)\s*,", text, re.M):
            out[kname] = params
    return out


def _struct_code(decl: str) -> str:
    """struct code a C parameter declaration needs: P pointer, q long long, i int, ..."""
    words = decl.replace("*", " * ").split()
    if "*" in words:
        return "P"
    if "CfTensorMap" in words:  # a CUtensorMap by value: 128 bytes, 128-aligned
        return "128s"
    t = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "volatile"))
    codes = {"long long": "q", "unsigned long long": "Q", "int": "i", "unsigned int": "I",
             "unsigned": "I", "float": "f", "double": "d", "size_t": "Q", "bool": "?",
             "long long int": "q", "int64_t": "q", "int32_t": "i", "uint32_t": "I"}
    assert t in codes, f"unknown parameter type in {decl!r}"
    return codes[t]


def _launch_sites() -> list[tuple[str, str, list[str] | None, int | None]]:
    """(file:line, source, kernel names or None = any of the source, number of args)."""
    import ast

    sites = []
    for fname in LAUNCHING_FILES:
        tree = ast.parse((REPO_ROOT / "cupyfuse" / fname).read_text())
        # module-level NAME = {...: "kernel", ...} tables, for get_function(src, NAME[key])
        tables = {}
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Dict)):
                vals = [v.value for v in node.value.values if isinstance(v, ast.Constant)]
                tables[node.targets[0].id] = vals
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("launch", "_Step")):
                continue
            gf = node.args[0]
            if (fname in ("backend/execute.py", "backend/prepared.py") or getattr(gf, "id", None) == "epilogue_fn") \
                    and not (isinstance(gf, ast.Call)
                             and getattr(gf.func, "id", None) == "get_function"):
                continue  # a generated kernel: its format is built from codegen's parameters
            assert isinstance(gf, ast.Call) and getattr(gf.func, "id", None) == "get_function"
            src = gf.args[0].value
            karg = gf.args[1]
            if isinstance(karg, ast.Constant):
                knames = [karg.value]
            elif isinstance(karg, ast.IfExp) and isinstance(karg.body, ast.Constant) \
                    and isinstance(karg.orelse, ast.Constant):   # "a" if ... else "b"
                knames = [karg.body.value, karg.orelse.value]
            elif isinstance(karg, ast.Subscript) and getattr(karg.value, "id", None) in tables:
                knames = tables[karg.value.id]
            else:
                knames = None
            nargs = len(node.args[3].elts) if len(node.args) > 3 and isinstance(
                node.args[3], (ast.Tuple, ast.List)) else None
            sites.append((f"{fname}:{node.lineno}", src, knames, nargs))
    return sites


def test_runtime_reads_every_kernel_signature() -> None:
    """runtime.kernel_formats (what launch packs with) agrees with this file's own reading
    of every kernels_cu signature: a wrong struct code would shift every later argument on
    the GPU."""
    from cupyfuse.backend import runtime

    n = 0
    for src in CU_FILES:
        want = {k: "".join(_struct_code(p) for p in v) for k, v in _kernel_params(src).items()}
        got = runtime.kernel_formats(runtime.expand_source(src))
        assert got == want, src
        assert set(got) == _kernels_declared(src), src
        n += len(got)
    assert n >= 15   # 19 kernels (2026-11-23)


def test_launch_sites_pass_every_parameter() -> None:
    """Every launch (and prepared step) passes exactly as many arguments as its kernel
    declares."""
    sites = _launch_sites()
    assert len(sites) >= 15, sites
    checked = 0
    for line, src, knames, nargs in sites:
        kernels = _kernel_params(src)
        assert kernels, f"no kernels parsed from {src}"
        names = knames if knames is not None else sorted(kernels)
        for name in names:
            assert name in kernels, f"{line}: {name} not in {src}"
            if nargs is not None:
                assert nargs == len(kernels[name]), \
                    f"{line}: {nargs} arguments for {src}:{name}, which takes {kernels[name]}"
                checked += 1
    assert checked >= 15, checked


def test_struct_code_parser() -> None:
    assert _struct_code("const float* __restrict__ z") == "P"
    assert _struct_code("RED::acc_t* partial") == "P"
    assert _struct_code("unsigned int* done") == "P"
    assert _struct_code("long long ldz") == "q"
    assert _struct_code("int nwin") == "i"
    assert _struct_code("float act_param") == "f"
    assert _struct_code("double add") == "d"
    params = _kernel_params("tail_rewrite.cu")["pairdiff_rows"]
    assert params[0].endswith("x") and params[1] == "long long ldx", params
    assert len(_kernel_params("tail_rewrite.cu")) >= 3


# ---------------------------------------------------------------------------------
# expand_source
# ---------------------------------------------------------------------------------
def _check_line_markers(expanded: str, root: Path) -> int:
    """Every non-directive line of the expansion is the line its #line marker says it is."""
    cur_file, cur_line = None, 0
    checked = 0
    cache: dict[str, list[str]] = {}
    for line in expanded.splitlines():
        m = re.fullmatch(r'#line (\d+) "([^"]+)"', line)
        if m:
            cur_line, cur_file = int(m.group(1)), m.group(2)
            continue
        assert cur_file is not None, "text before the first #line marker"
        src = cache.setdefault(cur_file, (root / cur_file).read_text().splitlines())
        original = src[cur_line - 1]
        if original.strip() == "#pragma once":
            assert line == "", line
        else:
            assert line == original, f"{cur_file}:{cur_line}: {line!r} != {original!r}"
            checked += 1
        cur_line += 1
    return checked


@pytest.mark.parametrize("name", CU_FILES)
def test_expand_real_sources(name: str) -> None:
    text = runtime.expand_source(name, root=KDIR)
    assert not re.search(r'^\s*#\s*include\s*"', text, re.M), "an include was left unexpanded"
    assert text.startswith(f'#line 1 "{name}"')
    assert _check_line_markers(text, KDIR) > 10
    # each header's body appears once however often it is included
    assert text.count("struct CfSum {") <= 1
    assert text.count("__device__ __forceinline__ float cf_nanmax") <= 1


@needs_nvcc
def test_expanded_source_compiles_alone(tmp_path: Path) -> None:
    """What NVRTC gets (no include path at all) compiles: the expansion is complete."""
    for name in CU_FILES:
        src = tmp_path / f"expanded_{name}"
        src.write_text(runtime.expand_source(name, root=KDIR))
        res = _nvcc(src, tmp_path / f"{name}.cubin")
        assert res.returncode == 0, res.stdout + res.stderr


def _tree(root: Path) -> None:
    (root / "a.cuh").write_text("#pragma once\n#define CF_A 1\n__device__ int fa() { return CF_A; }\n")
    (root / "b.cuh").write_text('#pragma once\n#include "a.cuh"\n#define CF_B 2\n'
                                "__device__ int fb() { return fa() + CF_B; }\n")
    (root / "main.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n#include <cstdint>\n'
                                  'extern "C" __global__ void k(int* o) { o[0] = fb(); }\n')


def test_expand_includes_once_with_markers(tmp_path: Path) -> None:
    _tree(tmp_path)
    text = runtime.expand_source("main.cu", root=tmp_path)
    assert text.count("#define CF_A 1") == 1
    assert text.count("#define CF_B 2") == 1
    lines = text.splitlines()
    assert lines[0] == '#line 1 "main.cu"'
    assert lines[1] == '#line 1 "a.cuh"'
    assert '#line 1 "b.cuh"' in lines
    assert '#line 2 "main.cu"' in lines and '#line 3 "main.cu"' in lines
    assert '#line 3 "b.cuh"' in lines           # after b.cuh's (already seen) include of a.cuh
    assert "#include <cstdint>" in lines           # system includes are left to the compiler
    assert not any(re.match(r'\s*#\s*include\s*"', ln) for ln in lines)
    assert text.index("#define CF_A 1") < text.index("#define CF_B 2") < text.index("__global__")
    _check_line_markers(text, tmp_path)


def test_expand_missing_include_names_the_file(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "bad.cu").write_text('#include "a.cuh"\n#include "nowhere.cuh"\n')
    with pytest.raises(FileNotFoundError) as ei:
        runtime.expand_source("bad.cu", root=tmp_path)
    assert "nowhere.cuh" in str(ei.value) and "bad.cu" in str(ei.value)
    with pytest.raises(FileNotFoundError, match="absent.cu"):
        runtime.expand_source("absent.cu", root=tmp_path)


def test_kernel_dir_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUPYFUSE_KERNELS_DIR", raising=False)
    assert runtime.kernel_dir().resolve() == KDIR.resolve()
    _tree(tmp_path)
    monkeypatch.setenv("CUPYFUSE_KERNELS_DIR", str(tmp_path))
    assert runtime.kernel_dir() == tmp_path
    text = runtime.expand_source("main.cu")
    assert "#define CF_B 2" in text
    with pytest.raises(FileNotFoundError):
        runtime.expand_source("tail_rewrite.cu")     # not in the overriding directory


@needs_nvcc
def test_line_markers_point_compiler_errors_at_the_header(tmp_path: Path) -> None:
    (tmp_path / "ok.cuh").write_text("#pragma once\n__device__ int ok() { return 1; }\n")
    (tmp_path / "broken.cuh").write_text("#pragma once\n// line 2\n"
                                         "__device__ int broken() { return undefined_name; }\n")
    (tmp_path / "main.cu").write_text('#include "ok.cuh"\n\n#include "broken.cuh"\n'
                                      'extern "C" __global__ void k(int* o) { o[0] = ok(); }\n')
    src = tmp_path / "expanded.cu"
    src.write_text(runtime.expand_source("main.cu", root=tmp_path))
    res = _nvcc(src, tmp_path / "x.cubin")
    assert res.returncode != 0
    assert re.search(r"broken\.cuh\(3\)", res.stdout + res.stderr), res.stdout + res.stderr


def test_expand_include_with_trailing_comment(tmp_path: Path) -> None:
    """'#include "x.cuh"  // comment' is an include too (a pattern requiring the line to
    end at the closing quote would leave such lines for NVRTC, which has no include
    path for kernels_cu)."""
    _tree(tmp_path)
    (tmp_path / "c.cu").write_text('#include "b.cuh"  // helpers\n#include "a.cuh" /* again */\n')
    text = runtime.expand_source("c.cu", root=tmp_path)
    assert "#define CF_B 2" in text
    assert not re.search(r'^\s*#\s*include\s*"', text, re.M)
