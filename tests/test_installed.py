"""The package under test is the one ``.ci/wheel.sh`` installed from the wheel, not the checkout it was built from.

``.ci/wheel.sh`` copies ``tests/`` away from the checkout and sets ``ODC_TEST_INSTALLED`` to the checkout's path;
these tests then fail if ``odc_runtime`` (or a sub-package mapped from a top-level folder: ``odc_runtime.kernels``,
``odc_runtime.bench``) was imported from that checkout, or if the installed distribution lacks what the wheel must
ship (its version, the ``odc-bench`` console script). Without ``ODC_TEST_INSTALLED`` (a checkout's test run) they
skip.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sysconfig
from pathlib import Path

import pytest

import odc_runtime

CHECKOUT = os.environ.get("ODC_TEST_INSTALLED")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="ODC_TEST_INSTALLED is not set (run by .ci/wheel.sh)")


def _site_packages() -> set[Path]:
    paths = sysconfig.get_paths()
    return {Path(paths[k]).resolve() for k in ("purelib", "platlib")}


@pytest.mark.parametrize("name", ["odc_runtime", *odc_runtime.SOURCE_FOLDERS])
def test_imported_from_the_installed_wheel_not_the_checkout(name):
    module = importlib.import_module(name)
    path = Path(module.__file__).resolve()
    assert not path.is_relative_to(Path(CHECKOUT).resolve()), f"{name} was imported from the checkout: {path}"
    assert any(path.is_relative_to(site) for site in _site_packages()), f"{name} is not installed: {path}"
    # installed layout: every sub-package inside the package's own directory (no finder mapping a source folder)
    assert path.is_relative_to(Path(odc_runtime.__file__).resolve().parent)


def test_installed_distribution_matches_the_package():
    dist = importlib.metadata.distribution("odc_runtime")
    assert dist.version == odc_runtime.__version__
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"odc-bench": "odc_runtime.bench.__main__:main"}
