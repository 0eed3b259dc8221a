"""The package metadata installs without setuptools' deprecation warnings."""

import sys
import warnings
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_license_is_an_spdx_string_and_installs_quietly():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    project = tomllib.loads(PYPROJECT.read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]  # PEP 639 strings
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist = apply_configuration(setuptools.Distribution(), PYPROJECT)
    assert [str(w.message).splitlines()[0] for w in seen] == []
    assert dist.metadata.license_expression == "Apache-2.0"
