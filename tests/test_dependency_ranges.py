"""pyproject's ranges are tested at both ends: every range (dependencies, every extra, requires-python) has a lower
and an upper bound; ``.ci/lowest-constraints.txt`` pins each direct dependency at its lower bound (the lowest
environment ``.ci/run`` builds and runs the switch and adapter tests in); and whatever environment runs the
suite holds releases inside the ranges (the README's install resolves the upper ends)."""
from __future__ import annotations

import platform
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOWEST = ROOT / ".ci" / "lowest-constraints.txt"


def requirements() -> list[Requirement]:
    """Every direct requirement: the dependencies and each extra's (the extras naming the project left out)."""
    listed = PROJECT["dependencies"] + [r for extra in PROJECT["optional-dependencies"].values() for r in extra]
    return [req for r in listed if (req := Requirement(r)).name != PROJECT["name"]]


def bounds(specifier: SpecifierSet) -> tuple[Version | None, Version | None]:
    """``(lowest, highest)`` release a range admits (None: unbounded); ``==``, ``>=`` and ``<=`` only."""
    lower = upper = None
    for spec in specifier:
        assert spec.operator in ("==", ">=", "<="), f"{specifier}: only ==, >= and <= bound a tested range"
        if spec.operator in ("==", ">="):
            lower = Version(spec.version)
        if spec.operator in ("==", "<="):
            upper = Version(spec.version)
    return lower, upper


def test_every_range_has_a_lower_and_an_upper_bound():
    unbounded = [str(req) for req in requirements() if None in bounds(req.specifier)]
    assert not unbounded, f"ranges without a tested end: {unbounded}"
    python = {spec.operator for spec in SpecifierSet(PROJECT["requires-python"])}
    assert ">=" in python and python & {"<", "<="}, PROJECT["requires-python"]


def test_the_lowest_constraints_pin_every_lower_bound():
    pins = {}
    for line in LOWEST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            [spec] = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = Version(spec.version)
    expected = {canonicalize_name(req.name): bounds(req.specifier)[0] for req in requirements()}
    assert pins == expected


def test_the_installed_releases_lie_in_the_ranges():
    outside = [f"{req.name} {version(req.name)} (range {req.specifier})" for req in requirements()
               if not req.specifier.contains(version(req.name), prereleases=True)]
    assert not outside, f"installed releases the ranges do not admit: {outside}"
    assert SpecifierSet(PROJECT["requires-python"]).contains(platform.python_version())
