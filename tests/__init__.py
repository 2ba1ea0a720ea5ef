"""pagedq's tests (a package, so tests/gateway/ is `tests.gateway`, never the top-level `gateway`)."""
