"""The installed package carries its own shared library and header."""
import os

import fusedgrpo


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
