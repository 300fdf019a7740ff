"""Build script: the pure-Python package always; the CUDA/NVSHMEM extension ``odc_runtime._C`` when possible.

``kernels/`` is installed as ``odc_runtime.kernels`` (never as a top-level ``kernels`` package).
"""

from setuptools import find_packages, setup

packages = find_packages(include=["odc_runtime", "odc_runtime.*"]) + ["odc_runtime.kernels"]

setup(
    packages=packages,
    package_dir={"odc_runtime.kernels": "kernels"},
)
