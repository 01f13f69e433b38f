"""A non-editable install (wheel) installs the one package ``cupyfuse``, carries the CUDA
sources inside it (``cupyfuse/kernels_cu/``) and finds them at run time; setup.cfg keeps
the CPU-only install free of CuPy and the extras the README names.

The wheel is built offline (``--no-build-isolation``: setuptools from this venv) from
a copy of the source tree, so the build never writes ``build/`` or ``*.egg-info`` into
the working tree and stale build output can never leak into the wheel.
"""
from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                 ".pytest_cache", ".venv", "bench_out", "*.whl")


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUPYFUSE_KERNELS_DIR")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_IGNORE)
    out = tmp / "dist"
    res = _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out),
               str(src), cwd=tmp)
    assert res.returncode == 0, res.stdout + res.stderr
    wheels = list(out.glob("cupyfuse-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    res = _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel),
               cwd=target)
    assert res.returncode == 0, res.stdout + res.stderr
    return target


def test_wheel_contains_only_the_cupyfuse_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/"
    stray = sorted(n for n in names if not n.startswith(("cupyfuse/", dist_info)))
    assert not stray, f"the wheel installs more than the cupyfuse package: {stray}"
    assert "cupyfuse/kernels_cu/__init__.py" in names
    for pattern in ("*.cu", "*.cuh"):
        expected = {f"cupyfuse/kernels_cu/{p.name}" for p in (REPO / "kernels_cu").glob(pattern)}
        assert expected, pattern
        assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    for p in (REPO / "cupyfuse").glob("*.py"):
        assert f"cupyfuse/{p.name}" in names, p.name
    top_level = zipfile.ZipFile(wheel).read(dist_info + "top_level.txt").decode().split()
    assert top_level == ["cupyfuse"], top_level


def _run_installed(target: Path, code: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUPYFUSE_KERNELS_DIR"}
    env["PYTHONPATH"] = str(target)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_installed_package_finds_its_kernels(installed: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    info = _run_installed(installed, """
        import importlib.util, json, cupyfuse, cupyfuse.kernels_cu
        from cupyfuse.backend import runtime
        text = runtime.expand_source("tail_rewrite.cu")
        print(json.dumps({"cupyfuse": cupyfuse.__file__,
                          "kernels_pkg": cupyfuse.kernels_cu.__file__,
                          "kernel_dir": str(runtime.kernel_dir()), "n": len(text),
                          "has_include": '#include "' in text,
                          "info_dir": cupyfuse.info()["kernels_cu"],
                          "top_level_kernels_cu": importlib.util.find_spec("kernels_cu") is not None}))
    """, cwd=elsewhere)
    target = installed.resolve()
    importable = sorted(p.name for p in target.iterdir()
                        if not p.name.endswith(".dist-info") and p.name != "bin")  # bin: scripts
    assert importable == ["cupyfuse"], importable
    for key in ("cupyfuse", "kernels_pkg", "kernel_dir", "info_dir"):
        assert Path(info[key]).resolve().is_relative_to(target), (key, info[key])
    assert Path(info["kernel_dir"]).resolve() == target / "cupyfuse" / "kernels_cu"
    assert not Path(info["cupyfuse"]).resolve().is_relative_to(REPO), "imported the checkout"
    assert not info["top_level_kernels_cu"], "a top-level kernels_cu package is importable"
    assert info["n"] > 1000 and not info["has_include"]


def test_source_tree_finds_the_top_level_kernels(tmp_path: Path) -> None:
    """From a checkout (``PYTHONPATH=.``), the sources are the repository's kernels_cu/."""
    env = {k: v for k, v in os.environ.items() if k != "CUPYFUSE_KERNELS_DIR"}
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run([sys.executable, "-c", "import cupyfuse.backend.runtime as r; print(r.kernel_dir())"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert Path(res.stdout.strip().splitlines()[-1]).resolve() == (REPO / "kernels_cu").resolve()


def test_installed_package_runs_an_op(installed: Path, tmp_path: Path) -> None:
    info = _run_installed(installed, """
        import json, torch, cupyfuse
        from cupyfuse.kernelbench.models import MatmulSigmoidSum
        torch.manual_seed(0)
        m = MatmulSigmoidSum(8, 6)
        x = torch.rand(3, 8)
        with torch.no_grad():
            ok = torch.allclose(cupyfuse.from_model(m)(x).double(), m.double()(x.double()),
                                atol=1e-4, rtol=1e-4)
        print(json.dumps({"ok": bool(ok)}))
    """, cwd=tmp_path)
    assert info["ok"]


def test_console_scripts_resolve(wheel: Path, installed: Path, tmp_path: Path) -> None:
    """Every console script the wheel declares points at an importable callable."""
    zf = zipfile.ZipFile(wheel)
    ep_files = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
    if not ep_files:
        pytest.skip("the wheel declares no entry points")
    info = _run_installed(installed, """
        import json
        from importlib.metadata import entry_points
        eps = [ep for ep in entry_points(group="console_scripts") if ep.value.startswith("cupyfuse")]
        bad = {}
        for ep in eps:
            try:
                fn = ep.load()
                assert callable(fn)
            except Exception as exc:
                bad[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
        print(json.dumps({"names": [ep.name for ep in eps], "bad": bad}))
    """, cwd=tmp_path)
    assert info["names"], "no cupyfuse console script found in the installed metadata"
    assert not info["bad"], info["bad"]


def test_setup_cfg_file_references_exist() -> None:
    """``file:`` directives in setup.cfg (long_description, ...) name files that exist:
    setuptools silently drops missing ones."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    for section in cfg.sections():
        for key, value in cfg.items(section, raw=True):
            if value.strip().startswith("file:"):
                for name in value.split(":", 1)[1].split(","):
                    assert (REPO / name.strip()).is_file(), f"[{section}] {key} = {value}"


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _listed(value: str, sep: str = ",") -> list[str]:
    """A setup.cfg list: one item a line, or (``sep``) several on one line."""
    items = value.replace(sep, "\n") if sep else value
    return [v.strip() for v in items.splitlines() if v.strip() and not v.strip().startswith("#")]


def test_setup_cfg_ships_every_package_inside_cupyfuse() -> None:
    """The packages are listed by hand: every package directory under cupyfuse/ must be
    listed (or it would silently be left out of the wheel), and the CUDA sources are mapped
    into the package."""
    opts = _setup_cfg()["options"]
    packages = set(_listed(opts["packages"]))
    assert all(p == "cupyfuse" or p.startswith("cupyfuse.") for p in packages), packages
    on_disk = {".".join(d.relative_to(REPO).parts) for d in (REPO / "cupyfuse").rglob("*")
               if d.is_dir() and (d / "__init__.py").is_file()}
    assert on_disk | {"cupyfuse", "cupyfuse.kernels_cu"} <= packages, sorted(on_disk - packages)
    mapping = dict(line.split("=", 1) for line in _listed(opts["package_dir"]))
    assert {k.strip(): v.strip() for k, v in mapping.items()} == {"cupyfuse.kernels_cu": "kernels_cu"}
    data = _listed(_setup_cfg()["options.package_data"]["cupyfuse.kernels_cu"])
    assert set(data) == {"*.cu", "*.cuh"}, data


def test_setup_cfg_requirements_and_extras() -> None:
    """The plain install (the README's CPU route) pulls no CuPy; each GPU extra pulls the
    CuPy of its CUDA major; the test extra holds what the suite imports."""
    cfg = _setup_cfg()
    install = _listed(cfg["options"]["install_requires"], sep="")
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in install}
    assert names == {"numpy", "torch"}, install
    assert all(re.search(r"[<>]", r) for r in install), f"unbounded requirement: {install}"
    extras = {k: _listed(v, sep="") for k, v in cfg.items("options.extras_require")}
    assert {"cuda12", "cuda13", "test", "bench"} <= set(extras), sorted(extras)
    for major in ("12", "13"):
        (req,) = extras[f"cuda{major}"]
        assert req.startswith(f"cupy-cuda{major}x") and "<" in req, req
    test = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in extras["test"]}
    assert {"pytest", "hypothesis", "matplotlib"} <= test, test
    assert not any(re.match(r"(cupy|nvidia)($|[-_])", n) for n in names | test), (names, test)
