"""The installed package carries its own shared library and header, and, when
built with nvcc, the CUDA backend beside them, which it needs only for CUDA."""
import ctypes
import os

import numpy as np
import pytest

import fusedgrpo
from fusedgrpo import _lib

CUDA_BACKEND = "libfusedgrpo_cuda.so"


def test_library_and_header_found():
    lib = fusedgrpo.library_path()
    assert os.path.isfile(lib)
    assert os.path.isfile(os.path.join(fusedgrpo.include_dir(), "fusedgrpo.h"))
    pkg = os.path.dirname(os.path.abspath(fusedgrpo.__file__))
    if "FUSEDGRPO_LIBRARY" not in os.environ and "site-packages" in pkg:
        # `pip install .` put libfusedgrpo.so.0 inside the package
        assert os.path.dirname(lib) == pkg


def test_version_and_names():
    assert fusedgrpo.__version__ == "0.1.0"
    assert fusedgrpo.LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo",
                                    "vespo")
    assert fusedgrpo.METRIC_NAMES[5:] == ("cispo_clip_ratio", "clip_ratio_low_min",
                                          "clip_ratio_high_max", "vespo_phi_seq_mean",
                                          "policy_loss")


def _cuda_backend_path():
    """The CUDA backend the core would open (src/api/context.c): FUSEDGRPO_CUDA_LIBRARY, else
    the one beside libfusedgrpo, else the loader's (by name)."""
    env = os.environ.get("FUSEDGRPO_CUDA_LIBRARY")
    if env:
        return env
    beside = os.path.join(os.path.dirname(fusedgrpo.library_path()), CUDA_BACKEND)
    return beside if os.path.isfile(beside) else CUDA_BACKEND


def _cuda_backend_loads():
    """Whether that library loads here: it exists, and its CUDA runtime and cuBLASLt are found
    (already in the process, its RUNPATH to the nvidia-* wheels, or the loader's path)."""
    try:
        ctypes.CDLL(_cuda_backend_path(), mode=ctypes.RTLD_LOCAL)
    except OSError:
        return False
    return True


def test_cuda_backend_unavailable_is_a_clean_error():
    """Where the CUDA backend cannot run (no libfusedgrpo_cuda.so; no CUDA runtime or cuBLASLt
    for it, as in a CPU-only root with the wheel; no device), asking for it is a FusedGRPOError
    with FG_ERR_UNSUPPORTED, not a crash, and the CPU works after it."""
    loads = _cuda_backend_loads()
    try:
        ctx = _lib.Context(_lib.BACKENDS["cuda"])
    except fusedgrpo.FusedGRPOError as e:
        assert e.status == "FG_ERR_UNSUPPORTED", e
    else:
        # Made: the backend loaded and found a device, which needs a loadable library.
        assert loads, "a CUDA context was made, but its backend library does not load"
        del ctx
    r = np.random.default_rng(0)
    out = fusedgrpo.fused_linear_grpo(r.standard_normal((1, 4, 8), np.float32),
                                      r.standard_normal((11, 8), np.float32),
                                      np.arange(4).reshape(1, 4), np.ones((1, 4), bool),
                                      np.ones(1, np.float32))
    assert np.isfinite(out.loss)


@pytest.mark.skipif(os.environ.get("FUSEDGRPO_EXPECT_CUDA_BACKEND") != "1",
                    reason="FUSEDGRPO_EXPECT_CUDA_BACKEND=1 not set (scripts/wheel_test.sh sets "
                           "it for a wheel built with nvcc)")
def test_cuda_backend_installed_beside_the_library():
    """A package built with nvcc carries libfusedgrpo_cuda.so beside libfusedgrpo.so.0 (where the
    core finds it), linked to the CUDA libraries by soname only (none bundled), with a RUNPATH
    to the CUDA 13 nvidia-* wheels of the same site-packages (cuda/CMakeLists.txt)."""
    pkg = os.path.dirname(os.path.abspath(fusedgrpo.__file__))
    path = os.path.join(pkg, CUDA_BACKEND)
    assert os.path.isfile(path)
    assert os.path.dirname(fusedgrpo.library_path()) == pkg
    with open(path, "rb") as f:
        data = f.read()
    assert b"$ORIGIN/../nvidia/cu13/lib" in data  # its RUNPATH, in .dynstr
    libs = os.path.join(os.path.dirname(pkg), "fusedgrpo.libs")
    bundled = os.listdir(libs) if os.path.isdir(libs) else []
    assert not [n for n in bundled if n.startswith(("libcudart", "libcublas", "libcuda"))]
