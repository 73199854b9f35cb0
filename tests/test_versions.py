"""The supported transformers range: declared once, checked at start-up, refused with a clear error."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

from verl_async import versions
from verl_async.config.cli import REPO_ROOT
from verl_async.versions import TRANSFORMERS_MIN, TRANSFORMERS_REQUIREMENT, UnsupportedTransformersError


@pytest.fixture
def installed(monkeypatch):
    """Pretend a given transformers version is installed (None: not installed)."""

    def set_version(version):
        monkeypatch.setattr(versions, "installed_transformers_version", lambda: version)

    return set_version


def test_pyproject_declares_the_range_the_check_enforces():
    text = (REPO_ROOT / "pyproject.toml").read_text()
    declared = re.findall(r'"(transformers[<>=!~][^"]*)"', text)
    assert declared == [TRANSFORMERS_REQUIREMENT]
    # CI installs exactly the floor (scripts/setup_tfmin.sh); it must be the range's lower bound
    assert TRANSFORMERS_REQUIREMENT.startswith(f"transformers>={TRANSFORMERS_MIN},")
    assert f"transformers=={TRANSFORMERS_MIN}" in (REPO_ROOT / "scripts" / "setup_tfmin.sh").read_text()


def test_the_installed_transformers_is_supported():
    assert versions.transformers_problem() is None, versions.transformers_problem()


@pytest.mark.parametrize("version", [TRANSFORMERS_MIN, "4.57.6", "5.0.0", "5.17.0", "5.24.0", "5.24.9"])
def test_supported_versions_pass(installed, version):
    installed(version)
    versions.check_transformers()


@pytest.mark.parametrize(
    "version,why",
    [("4.56.1", "too old"), ("4.55.4", "too old"), ("4.51.3", "too old"), ("5.25.0", "newer than the newest release tested"),
     ("6.0.0", "newer than the newest release tested"), ("6.0.0rc1", "newer than the newest release tested")],
)
def test_unsupported_versions_are_refused_naming_both_versions_and_the_fix(installed, version, why):
    installed(version)
    with pytest.raises(UnsupportedTransformersError) as err:
        versions.check_transformers()
    msg = str(err.value)
    assert f"transformers {version} is installed" in msg and why in msg
    assert TRANSFORMERS_REQUIREMENT in msg and f'pip install "{TRANSFORMERS_REQUIREMENT}"' in msg
    assert "\n" not in msg


def test_missing_or_unreadable_transformers_is_refused(installed):
    installed(None)
    with pytest.raises(UnsupportedTransformersError, match="transformers is not installed"):
        versions.check_transformers()
    installed("main")
    with pytest.raises(UnsupportedTransformersError, match="cannot read"):
        versions.check_transformers()


@pytest.mark.parametrize("package", ["verl_async.rollout.native", "verl_async.trainer"])
def test_importing_the_engine_or_trainer_refuses_an_old_transformers(installed, package):
    module = importlib.import_module(package)
    installed("4.55.4")
    with pytest.raises(UnsupportedTransformersError, match="transformers 4.55.4 is installed"):
        importlib.reload(module)


def test_preflight_refuses_before_any_other_check(installed):
    from verl_async.config.preflight import preflight

    installed("4.55.4")
    with pytest.raises(UnsupportedTransformersError):
        preflight(None)  # checked first: the config is not even looked at


def test_entry_point_prints_one_line_and_exits_2(tmp_path):
    patch = (
        "import importlib.metadata as m, runpy, sys; real = m.version; "
        "m.version = lambda name: '4.55.4' if name == 'transformers' else real(name); "
        "sys.argv = ['fully_async_main', 'hydra.run.dir=" + str(tmp_path) + "']; "
        "runpy.run_module('recipe.fully_async_main', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", patch], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "VERL_ASYNC_DRY_RUN": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: transformers 4.55.4 is installed (too old)"), lines
    assert "Traceback" not in proc.stderr + proc.stdout
