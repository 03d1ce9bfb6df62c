"""A package, so that pytest imports this folder's conftest.py as ``sb3_upstream.conftest``:
as a bare ``conftest`` it would stand in for tests/conftest.py, which the suite's tests import
by that name (``from conftest import ISOLATION``)."""
