"""Runtime: load ``kernels_cu`` sources with ``cupy.RawModule`` (NVRTC) and launch them.

* Sources are read from the ``kernels_cu`` directory (:func:`kernel_dir`: installed inside
  the package as ``cupyfuse/kernels_cu``, the repository's top-level ``kernels_cu/`` in a
  source checkout; ``CUPYFUSE_KERNELS_DIR`` overrides it). ``#include "x.cuh"`` lines are
  expanded here, recursively, with ``#line`` markers so NVRTC errors still name the
  original file and line. The compiled module is cached per (expanded source --
  so every included header is part of the key --, options, device). CuPy's own disk
  cache keys on the text it is given, which is the expanded text: editing a header
  can never reuse a stale binary.
* ``-arch`` comes from the device: ``sm_90a`` on compute capability 9.0 (wgmma/TMA
  need the ``a`` target), ``sm_XY`` elsewhere.
* NVRTC failures raise :class:`KernelCompileError` with the file name and the log.
* A kernel's parameters are declared once, in its CUDA source: :func:`kernel_formats`
  reads each ``extern "C" __global__`` signature (directly, or through a macro that
  declares one) into :mod:`struct` codes, and :func:`launch` packs the arguments with
  them -- in C layout, handing ``cuLaunchKernel`` a pointer to each (``kernelParams``; the
  ``extra`` buffer form lost 128-byte-aligned parameters) -- and raises a kernel's
  dynamic shared-memory limit when it asks for more than 48 KB.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any, Callable, Sequence
from cupyfuse import caches
from cupyfuse import config

__all__ = [
    "KernelCompileError",
    "kernel_dir",
    "expand_source",
    "expand_text",
    "get_function",
    "generated_kernel",
    "kernel_formats",
    "launch",
    "arch_for_device",
]

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*(//.*|/\*.*\*/\s*)?$')
_DEFAULT_OPTIONS = ("-std=c++17",)


class KernelCompileError(RuntimeError):
    """NVRTC could not compile a ``kernels_cu`` source; the message holds its log."""


def kernel_dir() -> Path:
    """Directory holding the ``.cu``/``.cuh`` sources.

    In this order: ``CUPYFUSE_KERNELS_DIR`` if set; the ``cupyfuse.kernels_cu`` package of
    an install (wheel: ``site-packages/cupyfuse/kernels_cu/``; editable installs map it to
    the checkout's ``kernels_cu/``); the repository's top-level ``kernels_cu/`` beside this
    package when running from the source tree (``PYTHONPATH=.``).
    """
    env = os.environ.get("CUPYFUSE_KERNELS_DIR")
    if env:
        return Path(env)
    import importlib.util

    spec = importlib.util.find_spec("cupyfuse.kernels_cu")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if Path(loc).is_dir():
                return Path(loc).resolve()
    source_tree = Path(__file__).resolve().parents[2] / "kernels_cu"
    if source_tree.is_dir():
        return source_tree
    raise FileNotFoundError(
        f"cupyfuse's CUDA sources were not found: no cupyfuse.kernels_cu package and no "
        f"{source_tree}; reinstall cupyfuse or set CUPYFUSE_KERNELS_DIR")


def expand_source(name: str, root: Path | None = None) -> str:
    """Return ``name`` with its ``#include "..."`` lines expanded (each header once).

    ``#line`` markers keep compiler messages pointing at the original files.
    Raises ``FileNotFoundError`` naming the file that includes a missing header.
    """
    return "\n".join(_expander(root, set())(name, None)) + "\n"


def expand_text(text: str, root: Path | None = None) -> str:
    """A generated source with its ``#include "..."`` lines expanded as by
    :func:`expand_source` (each header once across all of them)."""
    expand = _expander(root, set())
    out: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        m = _INCLUDE_RE.match(line)
        out.extend(expand(m.group(1), None) + [f'#line {lineno + 1} "generated"'] if m else [line])
    return "\n".join(out) + "\n"


def _expander(root: Path | None, seen: set[str]) -> Callable[[str, str | None], list[str]]:
    root = kernel_dir() if root is None else root

    def expand(rel: str, included_from: str | None) -> list[str]:
        path = root / rel
        if not path.is_file():
            where = f" (included from {included_from})" if included_from else ""
            raise FileNotFoundError(f"kernel source {path} not found{where}")
        if rel in seen:
            return []
        seen.add(rel)
        out = [f'#line 1 "{rel}"']
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            m = _INCLUDE_RE.match(line)
            if m:
                out.extend(expand(m.group(1), rel))
                out.append(f'#line {lineno + 1} "{rel}"')
            elif line.strip() == "#pragma once":
                out.append("")
            else:
                out.append(line)
        return out

    return expand


def arch_for_device(device_id: int) -> str:
    """``-arch`` value for a device: ``sm_90a`` on Hopper, ``sm_<cc>`` elsewhere."""
    import cupy

    cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
    return "sm_90a" if cc == "90" else f"sm_{cc}"


#: held while a module is compiled or loaded: loading a module synchronises the device,
#: which breaks a CUDA-graph capture in progress in any thread (seen as "operation failed
#: due to a previous error during capture" with several threads calling fused modules for
#: the first time, when the named modules captured graphs of their own)
_lock = threading.RLock()
load_lock = _lock
_modules: dict[tuple[str, tuple[str, ...], int], Any] = caches.register("NVRTC modules", {})
_functions: dict[tuple[str, str, int, tuple[str, ...]], Any] = caches.register(
    "kernel functions", {})




def _module(source_name: str, device_id: int, extra_options: tuple[str, ...]) -> Any:
    import cupy

    text = expand_source(source_name)
    options = _DEFAULT_OPTIONS + (f"-arch={arch_for_device(device_id)}",) + extra_options
    digest = hashlib.sha256(text.encode()).hexdigest()
    key = (digest, options, device_id)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            with cupy.cuda.Device(device_id):
                try:
                    mod = cupy.RawModule(code=text, options=options)
                    mod.compile()
                except cupy.cuda.compiler.CompileException as exc:
                    raise KernelCompileError(
                        f"NVRTC could not compile kernels_cu/{source_name} "
                        f"(options {' '.join(options)}):\n{exc}"
                    ) from exc
            _modules[key] = mod
        return mod


_GLOBAL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+'
                        r'(?:(?:__(?:launch_bounds|cluster_dims)__|CF_ROW_CLUSTER)\([^)]*\)\s*)*'
                        r'(\w+)\s*\(')
_MACRO_DEF_RE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\((\w+)[^)]*\)((?:[^\n]*\\\n)*[^\n]*)",
                           re.M)
_TYPE_CODES = {"long long": "q", "long long int": "q", "int64_t": "q", "unsigned long long": "Q",
               "size_t": "Q", "int": "i", "int32_t": "i", "unsigned int": "I", "unsigned": "I",
               "uint32_t": "I", "float": "f", "double": "d"}


def param_code(decl: str) -> str:
    """The struct code of one C parameter declaration: ``P`` any pointer, ``q`` long long,
    ``i`` int, ``I`` unsigned, ``f`` float, ``d`` double, ``128s`` a CUtensorMap by value."""
    words = decl.replace("*", " * ").split()
    if "*" in words:
        return "P"
    if "CfTensorMap" in words:
        return "128s"
    t = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "volatile",
                                                      "__grid_constant__"))
    if t not in _TYPE_CODES:
        raise ValueError(f"kernel parameter {decl!r}: no launch code for type {t!r}")
    return _TYPE_CODES[t]


def _params_in(text: str, open_paren: int) -> list[str]:
    depth = 0
    for i in range(open_paren, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                inner = text[open_paren + 1:i].replace("\\\n", " ").strip()
                return [p.strip() for p in inner.split(",") if p.strip()] if inner else []
    raise ValueError("unbalanced parentheses in a kernel signature")


_formats: dict[str, dict[str, str]] = {}


def kernel_formats(text: str) -> dict[str, str]:
    """The launch format (struct codes, see :func:`launch`) of every ``extern "C"`` kernel of
    a CUDA source: declared directly, or through a macro whose body declares a
    ``__global__`` function named by its first parameter (``CF_ROW_TAIL(name, ...)``)."""
    key = hashlib.sha256(text.encode()).hexdigest()
    out = _formats.get(key)
    if out is not None:
        return out
    out = {}
    plain = "\n".join(ln for ln in text.splitlines() if not ln.rstrip().endswith("\\"))
    for m in _GLOBAL_RE.finditer(plain):
        out[m.group(1)] = "".join(param_code(p) for p in _params_in(plain, m.end() - 1))
    for macro, param, body in _MACRO_DEF_RE.findall(text):
        body = body.replace("\\\n", " ")
        m = re.search(rf"__global__.*?\b{param}\s*\(", body)
        if not m:
            continue
        fmt = "".join(param_code(p) for p in _params_in(body, m.end() - 1))
        for kname in re.findall(rf"^\s*{macro}\(\s*(\w+)\s*,", text, re.M):
            out[kname] = fmt
    _formats[key] = out
    return out


class Kernel:
    """A compiled ``extern "C"`` kernel: its CuPy ``RawKernel``, its CUfunction handle and
    its launch format (read from its signature by :func:`kernel_formats`)."""

    __slots__ = ("raw", "ptr", "name", "fmt", "max_dynamic_smem")

    def __init__(self, raw: Any, name: str, fmt: str) -> None:
        self.raw = raw
        self.ptr = raw.kernel.ptr
        self.name = name
        self.fmt = fmt
        # dynamic shared memory allowed without the opt-in attribute: 48 KB less the
        # kernel's static shared memory (unknown here: 32 KB taken as safe)
        self.max_dynamic_smem = 32 * 1024


def get_function(source_name: str, function: str, device_id: int,
                 extra_options: Sequence[str] = ()) -> Kernel:
    """The ``extern "C"`` kernel ``function`` of ``kernels_cu/<source_name>`` for a device."""
    extra = tuple(extra_options)
    fkey = (source_name, function, device_id, extra)
    fn = _functions.get(fkey)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(fkey)
        if fn is None:
            mod = _module(source_name, device_id, extra)
            fmts = kernel_formats(expand_source(source_name))
            if function not in fmts:
                raise KernelCompileError(f"kernels_cu/{source_name} declares no extern \"C\" "
                                         f"kernel {function!r} (it has {sorted(fmts)})")
            import cupy

            with cupy.cuda.Device(device_id):
                fn = Kernel(mod.get_function(function), function, fmts[function])
            _functions[fkey] = fn
        return fn


_generated: dict[tuple[str, int], Kernel] = caches.register("generated kernels", {})


def generated_kernel(name: str, source: str, device_id: int) -> Kernel:
    """The generated kernel ``name`` of ``source`` (cupyfuse.backend.codegen's tail kernels,
    epilogues and their variants) for a device, compiled by NVRTC once per name (the
    name carries a digest of the source)."""
    key = (name, device_id)
    fn = _generated.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _generated.get(key)
        if fn is not None:
            return fn
        import sys
        import time

        import cupy

        text = expand_text(source)
        options = ("-std=c++17", f"-arch={arch_for_device(device_id)}")
        t0 = time.perf_counter()
        with cupy.cuda.Device(device_id):
            try:
                raw = cupy.RawModule(code=text, options=options).get_function(name)
            except cupy.cuda.compiler.CompileException as exc:
                raise KernelCompileError(
                    f"NVRTC could not compile the generated tail kernel {name}:\n{exc}\n"
                    f"--- source ---\n{source}") from exc
        dt = time.perf_counter() - t0
        if dt > config.COMPILE_NOTICE_S:
            print(f"cupyfuse: compiled tail kernel {name} in {dt:.1f} s (cached from now on)",
                  file=sys.stderr)
        fn = Kernel(raw, name, kernel_formats(source)[name])
        _generated[key] = fn
        return fn




_SIZES = {"P": 8, "q": 8, "Q": 8, "d": 8, "i": 4, "I": 4, "f": 4}
_layouts: dict[str, tuple[list[tuple[str, int]], int]] = {}


def _layout(fmt: str) -> tuple[list[tuple[str, int]], int]:
    """(struct code, offset) of each parameter in C layout, and the total size.

    ``128s`` is a 128-byte, 128-aligned blob (a CUtensorMap passed by value).
    """
    lay = _layouts.get(fmt)
    if lay is None:
        items = []
        off = 0
        for count, code in re.findall(r"(\d*)([a-zA-Z])", fmt):
            if code == "s":
                size = int(count)
                align = 128 if size == 128 else 1
                code = f"{size}s"
            else:
                if count:
                    raise ValueError(f"launch format {fmt!r}: repeat counts only for 's'")
                size = align = _SIZES[code]
            off = -(-off // align) * align
            items.append((code, off))
            off += size
        lay = (items, off)
        _layouts[fmt] = lay
    return lay


class _Packer:
    """A reusable C-layout parameter buffer for one launch format (one per thread).

    ``cuLaunchKernel`` copies the parameters before it returns, so the buffer can be
    refilled for the next launch at once; packing is then one ``Struct.pack_into``.
    """

    __slots__ = ("st", "buf", "off", "ptrs", "n")

    def __init__(self, fmt: str) -> None:
        items, total = _layout(fmt)
        sfmt = "<"
        end = 0
        for code, off in items:
            sfmt += "x" * (off - end) + ("Q" if code == "P" else code)
            end = off + (int(code[:-1]) if code.endswith("s") else _SIZES[code])
        self.st = struct.Struct(sfmt)
        self.buf = ctypes.create_string_buffer(max(total, 1) + 128)
        base = (ctypes.addressof(self.buf) + 127) & ~127
        self.off = base - ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * len(items))(*[base + off for _, off in items])
        self.n = len(items)


_tls = threading.local()


def _packer(fmt: str) -> _Packer:
    cache = getattr(_tls, "packers", None)
    if cache is None:
        cache = _tls.packers = {}
    pk = cache.get(fmt)
    if pk is None:
        pk = cache[fmt] = _Packer(fmt)
    return pk


class _LaunchAttr(ctypes.Structure):   # CUlaunchAttribute: an id, then a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):   # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("nattrs", ctypes.c_uint)]


_PDL_ATTR = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_launch_ex: Any = None


def launch_dependent(fptr: int, g0: int, g1: int, g2: int, b0: int, b1: int, b2: int,
                     smem: int, stream: int, params: int, extra: int = 0) -> None:
    """``cuLaunchKernel``'s arguments, launched as a programmatic dependent launch
    (``cuLaunchKernelEx`` with programmatic stream serialization): the kernel may start
    before the stream's previous kernel has finished, once that kernel's blocks have all
    run ``griddepcontrol.launch_dependents`` (or exited); it must run
    ``griddepcontrol.wait`` before it reads anything that kernel writes (or writes what
    it reads). The wide GEMM triggers at its start, and the certification kernel waits
    after x's pass (kernels_cu/tail_certify.cuh)."""
    global _launch_ex
    if not config.DEPENDENT_LAUNCHES:
        from cupy.cuda import driver

        driver.launchKernel(fptr, g0, g1, g2, b0, b1, b2, smem, stream, params, extra)
        return
    fn = _launch_ex
    if fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_ex = fn
    keep = getattr(_tls_cfg, "keep", None)
    if keep is None:   # this thread's config (the attribute array it points to kept too)
        cfg, attr = _LaunchConfig(), _LaunchAttr()
        attr.id = _PDL_ATTR
        attr.value[0] = 1   # programmaticStreamSerializationAllowed
        cfg.attrs = ctypes.pointer(attr)
        cfg.nattrs = 1
        keep = _tls_cfg.keep = (cfg, attr)
    cfg = keep[0]
    cfg.grid[0], cfg.grid[1], cfg.grid[2] = g0, g1, g2
    cfg.block[0], cfg.block[1], cfg.block[2] = b0, b1, b2
    cfg.smem, cfg.stream = smem, stream
    rc = fn(ctypes.addressof(cfg), fptr, params, extra)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch) failed with "
                           f"CUresult {rc}")


_tls_cfg = threading.local()


def launch(fn: Kernel, grid: int | tuple[int, ...], block: int | tuple[int, ...],
           args: tuple, shared_mem: int = 0, stream: int | None = None,
           dependent: bool = False) -> None:
    """Launch ``fn`` on ``stream`` (a raw stream pointer), by default CuPy's current stream
    (interop sets it to the caller's stream).

    ``args`` follow the kernel's signature; ``fn.fmt`` (read from it) spells them in
    :mod:`struct` codes -- ``P`` pointer (pass an int device address, 0 for NULL), ``q``
    long long, ``i`` int, ``I`` unsigned, ``f`` float, ``d`` double, ``128s`` a 128-byte
    tensor map by value. The values are packed, in C layout, into a per-thread buffer, and
    ``cuLaunchKernel`` gets a pointer to each (``kernelParams``): a few microseconds, where
    converting each argument through ``RawKernel.__call__`` costs several times more.
    ``dependent``: a programmatic dependent launch (:func:`launch_dependent`).
    """
    import cupy
    from cupy.cuda import driver

    g = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
    b = (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))
    if g[0] <= 0 or g[1] <= 0 or g[2] <= 0:
        return
    if shared_mem > fn.max_dynamic_smem:
        fn.raw.max_dynamic_shared_size_bytes = shared_mem
        fn.max_dynamic_smem = shared_mem
    pk = _packer(fn.fmt)
    if pk.n != len(args):
        raise ValueError(f"launch {fn.name}: the kernel takes {pk.n} parameters "
                         f"({fn.fmt!r}), got {len(args)} arguments")
    pk.st.pack_into(pk.buf, pk.off, *args)
    if stream is None:
        stream = cupy.cuda.get_current_stream().ptr
    (launch_dependent if dependent else driver.launchKernel)(
        fn.ptr, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream,
        ctypes.addressof(pk.ptrs), 0)
