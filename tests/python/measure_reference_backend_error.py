"""The worst error of the reference backend against the CPU's, the measurement
behind test_device_backends.REFERENCE_TOL: for every loss type and level,
SEEDS inputs (the test's own seed first), the torch op through the reference
backend's context against the CPU context. Prints each quantity's worst
relative error and the case it came from.

    python3 tests/python/measure_reference_backend_error.py 200
    DNNL_MAX_CPU_ISA=SSE41 python3 tests/python/measure_reference_backend_error.py 200
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_device_backends as tdb  # noqa: E402


def main(seeds):
    worst = {}
    for loss_type in tdb.LOSS_TYPES:
        for level in ("token", "sequence"):
            for k in range(seeds):
                seed = tdb._seed(loss_type, level) + k
                for what, (_, err) in tdb.reference_errors(seed, loss_type, level).items():
                    if err > worst.get(what, (-1.0,))[0]:
                        worst[what] = (err, f"{loss_type} {level} seed {seed}")
    for what, (err, case) in sorted(worst.items()):
        print(f"{what:28s} {err:.3g}  ({case})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
