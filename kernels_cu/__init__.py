"""CUDA C++ sources of cupyfuse (``*.cu`` kernels, ``*.cuh`` building blocks).

Installed as package data beside ``cupyfuse`` so that a non-editable install finds them;
``cupyfuse.runtime.kernel_dir()`` locates this directory.
"""
