"""CUDA C++ sources of cupyfuse (``*.cu`` kernels, ``*.cuh`` building blocks).

Kept at the repository's top level and installed inside the package, as
``cupyfuse.kernels_cu`` (setup.cfg: ``package_dir``, ``package_data``), so a wheel installs
the one package ``cupyfuse``; ``cupyfuse.backend.runtime.kernel_dir()`` locates this directory in
both layouts.
"""
