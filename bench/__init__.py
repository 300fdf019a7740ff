"""The benchmarks of odc_runtime, installed as ``odc_runtime.bench`` (the ``bench/`` folder of a checkout).

Each tool runs three ways: ``python bench/<tool>.py`` from a checkout, ``python -m odc_runtime.bench.<tool>`` and
``odc-bench <tool>`` from an installed package (see :mod:`odc_runtime.bench.__main__` for the list). Nothing is
imported here: ``import odc_runtime.bench.schedule`` loads only what that module needs.
"""
