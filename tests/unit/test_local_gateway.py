"""`pagedq up` names what its gateway lacks when the `gateway` extra is not installed."""

from __future__ import annotations

import sys

from worker.local import gateway_missing


def test_the_gateway_is_found_where_its_extra_is_installed():
    assert gateway_missing() is None


def test_a_missing_extra_is_named_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "starlette", None)  # as if not installed: find_spec gives None
    said = gateway_missing()
    assert said is not None and "starlette" in said and "uvicorn" not in said
    assert "pip install 'pagedq[gateway]'" in said and "--no-gateway" in said
