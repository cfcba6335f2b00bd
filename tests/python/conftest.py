"""Shared setup of the Python tests.

JAX reads XLA_FLAGS when its CPU backend starts, so the 4 host devices for
the shard_map tests are requested here, before any test imports jax."""
import os

_flag = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
