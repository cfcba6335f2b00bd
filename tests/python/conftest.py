"""Shared setup of the Python tests.

JAX reads XLA_FLAGS when its CPU backend starts, so the 4 host devices for
the shard_map tests are requested here, before any test imports jax.
At the end of the session, the tolerance table (tolerance.py): each named
tolerance, the worst error the session measured against it, and their ratio."""
import os

import tolerance

_flag = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.section("tolerances: normwise relative error, worst measured")
    for line in tolerance.summary_lines():
        terminalreporter.write_line(line)
