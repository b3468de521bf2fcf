"""The matrix of wrapper x case under torchrun (``matrix.py``): each check of each case a test, ``<case>-<check>`` (and
the launch's process count where a case runs in several: ``zero3_tiny-2proc-gathers_as_untiled``). A launch runs its
cases once, when its first test needs it: those of its cases that pytest selected (``-k``), in the matrix's order."""

from __future__ import annotations

import copy
import importlib.util
from typing import Callable

import pytest

from .harness import Suite, assert_all_checked, launch as run_launch
from .matrix import MATRIX, Case, cases_of
from .wrappers import LAUNCHES, Launch

pytestmark = pytest.mark.distributed


def _case_id(case: Case, launch: Launch) -> str:
    return f"{case.name}-{launch.label}" if len(case.runs_in) > 1 else case.name


CHECKS = [pytest.param(case, launch, check, id=f"{_case_id(case, launch)}-{check.name}")
          for launch in LAUNCHES for case in cases_of(launch) for check in case.checks]


@pytest.fixture(scope="session")
def suite_of(request: pytest.FixtureRequest) -> Callable[[Launch], Suite]:
    """``launch`` run once per session: the cases pytest selected from it."""
    suites: dict[str, Suite] = {}

    def suite(launch: Launch) -> Suite:
        if launch.needs and importlib.util.find_spec(launch.needs) is None:
            pytest.skip(f"{launch.name} needs {launch.needs}: pip install -e '.[test,{launch.needs}]'")
        if launch.name not in suites:
            params = [item.callspec.params for item in request.session.items if hasattr(item, "callspec")]
            selected = {p["case"].name for p in params if "case" in p and p.get("launch") == launch}
            names = tuple(case.name for case in cases_of(launch) if case.name in selected)
            suites[launch.name] = run_launch(f"matrix:{launch.name}", nproc=launch.nproc, cases=names,
                                             device=launch.device())
        return suites[launch.name]

    return suite


@pytest.mark.parametrize("case, launch, check", CHECKS)
def test_case(suite_of: Callable[[Launch], Suite], case: Case, launch: Launch, check) -> None:
    suite = suite_of(launch)
    check(copy.deepcopy(suite.metrics(case.name)), case, suite.nproc)


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: launch.name)
def test_every_case_checked(suite_of: Callable[[Launch], Suite], launch: Launch) -> None:
    """Every case a launch ran is a case of the matrix there, with a check."""
    assert all(case.checks for case in cases_of(launch))
    assert_all_checked(suite_of(launch), {case.name for case in cases_of(launch)})


def test_each_case_is_named_once_per_launch() -> None:
    for launch in LAUNCHES:
        names = [case.name for case in cases_of(launch)]
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(case.runs_in for case in MATRIX)
