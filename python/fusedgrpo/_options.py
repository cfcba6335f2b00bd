"""The loss options and the per-call execution options of every front end, described
once: each option's name (docs/LOSS_SPEC.md, TRL 1.16 GRPOConfig's), default,
Python type, valid range and the C sentinel its Python ``None`` stands for.
``loss_config`` validates a front end's options and builds the fg_loss_config
the C library reads; ``make_exec`` does the same for threads and memory_budget.
A value outside its range raises FusedGRPOError naming the option and the value,
before anything reaches the library (whose own checks are the second line).

The front ends take the loss options as ``**options`` (``with_loss_options``
shows them in their signatures); the JAX FFI handler reads the fg_loss_config's
bytes (``config_bytes``), so no front end decodes the options again.
"""
from __future__ import annotations

import ctypes
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import _lib
from ._lib import FusedGRPOError

__all__ = ["Option", "LOSS_OPTIONS", "OPTION_NAMES", "LOSS_TYPES", "LEVELS", "NORMALISER",
           "MAX_THREADS",
           "MAX_MEMORY_BUDGET", "loss_config", "config_bytes", "make_exec", "check_threads",
           "check_memory_budget", "with_loss_options", "loss_options_of"]


def _names(name_of) -> tuple:
    """The C library's names of an enum (fg_loss_type_name / fg_is_level_name), in
    value order: the front ends hold no copy of them."""
    names = []
    while (n := name_of(len(names))) is not None:
        names.append(n.decode())
    return tuple(names)


LOSS_TYPES = _names(_lib.lib.fg_loss_type_name)   # ("grpo", "bnpo", ..., "vespo")
LEVELS = _names(_lib.lib.fg_is_level_name)        # ("token", "sequence")
# What each loss type's policy term is divided by (docs/LOSS_SPEC.md
# "Aggregation"), which the data-parallel front ends (fusedgrpo.jax's sharded
# call, the TRL trainer) need to split a batch as TRL does.
NORMALISER = {"grpo": "sequences", "dr_grpo": "sequences", "sapo": "sequences",
              "luspo": "sequences", "bnpo": "tokens", "dapo": "num_items_in_batch",
              "cispo": "num_items_in_batch", "vespo": "num_items_in_batch"}
if set(NORMALISER) != set(LOSS_TYPES):
    raise ImportError(f"fusedgrpo: NORMALISER lists {sorted(NORMALISER)}, the library's loss "
                      f"types are {sorted(LOSS_TYPES)}")
MAX_THREADS = 4096                                # FG_MAX_THREADS of fusedgrpo.h
MAX_MEMORY_BUDGET = 2 ** 63 - 1                   # bytes (int64's range, as the tool's)


# ------------------------------------------------------------------ value checks
# Each takes (name, value) and returns the value as the C field holds it, or
# raises FusedGRPOError naming the option and the value.

def _fail(name, requirement, value, status="FG_ERR_BAD_HYPERPARAMETER"):
    raise FusedGRPOError(status, f"{name} must be {requirement}, got {value!r}")


def _real(name, value, requirement, status="FG_ERR_BAD_HYPERPARAMETER") -> float:
    """value as a float: a real number (not a bool, a string or None). -0.0 is
    0.0, so that equal options give equal fg_loss_config bytes (config_bytes)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        _fail(name, requirement, value, status)
    return float(value) + 0.0


def _float_check(test: Callable[[float], bool], requirement: str, unset: Optional[float] = None,
                 status="FG_ERR_BAD_HYPERPARAMETER"):
    def check(name, value):
        if value is None and unset is not None:
            return unset
        x = _real(name, value, requirement, status)
        if not test(x):
            _fail(name, requirement, value, status)
        return x
    return check


def _finite(x):
    return math.isfinite(x)


def _temperature(name, value):
    requirement = "a finite number > 0 (with a finite reciprocal)"
    x = _real(name, value, requirement, "FG_ERR_BAD_TEMPERATURE")
    if not (math.isfinite(x) and x > 0 and math.isfinite(1.0 / x)):
        _fail(name, requirement, value, "FG_ERR_BAD_TEMPERATURE")
    return x


def _max_completion_length(name, value):
    if value is None:
        return 0  # FG_MAX_COMPLETION_LENGTH_T: T
    requirement = "an integer in [1, 2**63 - 1] (or None: T)"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        _fail(name, requirement, value)
    if not 1 <= int(value) <= 2 ** 63 - 1:
        _fail(name, requirement, value)
    return int(value)


def _off_policy_threshold(name, value):
    if value is None:
        return math.inf  # off
    x = _real(name, value, "a number (or None / +inf: off)")
    if math.isnan(x) or x == -math.inf:
        _fail(name, "a number (or None / +inf: off)", value)
    return x


def _bool(name, value):
    if not isinstance(value, (bool, np.bool_, numbers.Integral)) or int(value) not in (0, 1):
        _fail(name, "True or False", value)
    return 1 if value else 0


def _choice(choices, status):
    def check(name, value):
        if value not in choices:
            raise FusedGRPOError(status, f"unknown {name} {value!r}; one of {choices}")
        return choices.index(value)
    return check


@dataclass(frozen=True)
class Option:
    """One field of fg_loss_config as the front ends take it: its name (the C
    field's), default (None: the C sentinel ``check`` writes for it), Python
    type, valid range in words, and ``check(name, value)``: the C field's value
    or FusedGRPOError."""
    name: str
    default: Any
    type: type
    valid: str
    check: Callable[[str, Any], Any]


_OPTIONS = (
    Option("loss_type", "dapo", str, f"one of {LOSS_TYPES}",
           _choice(LOSS_TYPES, "FG_ERR_UNKNOWN_LOSS_TYPE")),
    Option("importance_sampling_level", "token", str, f"one of {LEVELS}",
           _choice(LEVELS, "FG_ERR_UNKNOWN_LEVEL")),
    Option("temperature", 1.0, float, "finite, > 0", _temperature),
    Option("epsilon_low", 0.2, float, "finite, >= 0",
           _float_check(lambda x: _finite(x) and x >= 0, "a finite number >= 0")),
    Option("epsilon_high", None, float, "finite, >= 0; None: epsilon_low",
           _float_check(lambda x: _finite(x) and x >= 0,
                        "a finite number >= 0 (or None: same as epsilon_low)", unset=-1.0)),
    Option("delta", None, float, "finite, > 0; None: off",
           _float_check(lambda x: _finite(x) and x > 0, "a finite number > 0 (or None: off)",
                        unset=0.0)),
    Option("beta", 0.0, float, "finite, >= 0",
           _float_check(lambda x: _finite(x) and x >= 0, "a finite number >= 0")),
    Option("max_completion_length", None, int, "integer >= 1; None: T",
           _max_completion_length),
    Option("num_items_in_batch", None, float, "finite, > 0; None: the unmasked token count",
           _float_check(lambda x: _finite(x) and x > 0,
                        "a finite number > 0 (or None: the unmasked token count)", unset=-1.0)),
    Option("sapo_temperature_pos", 1.0, float, "finite, > 0",
           _float_check(lambda x: _finite(x) and x > 0, "a finite number > 0")),
    Option("sapo_temperature_neg", 1.05, float, "finite, > 0",
           _float_check(lambda x: _finite(x) and x > 0, "a finite number > 0")),
    Option("use_bias_correction_kl", False, bool, "True or False", _bool),
    Option("entropy_coef", 0.0, float, "finite", _float_check(_finite, "a finite number")),
    Option("vespo_k_pos", 2.0, float, "finite, > 0",
           _float_check(lambda x: _finite(x) and x > 0, "a finite number > 0")),
    Option("vespo_lambda_pos", 3.0, float, "finite, > 0",
           _float_check(lambda x: _finite(x) and x > 0, "a finite number > 0")),
    Option("vespo_k_neg", 3.0, float, "finite, > 0",
           _float_check(lambda x: _finite(x) and x > 0, "a finite number > 0")),
    Option("vespo_lambda_neg", 2.0, float, "finite, > 0",
           _float_check(lambda x: _finite(x) and x > 0, "a finite number > 0")),
    Option("off_policy_mask_threshold", None, float, "a number; None or +inf: off",
           _off_policy_threshold),
    Option("top_entropy_quantile", 1.0, float, "in [0, 1]; 1: off",
           _float_check(lambda x: 0.0 <= x <= 1.0, "a number in [0, 1] (1: off)")),
)

LOSS_OPTIONS = {o.name: o for o in _OPTIONS}
OPTION_NAMES = tuple(LOSS_OPTIONS)

# Every fg_loss_config field is an option and every option a field (the ctypes
# struct is checked against the library's at load): a field added to the C
# config without an entry here refuses to import.
if OPTION_NAMES != tuple(n for n, _ in _lib.fg_loss_config._fields_):
    raise ImportError("fusedgrpo: the loss options of _options.py differ from fg_loss_config's "
                      f"fields: {OPTION_NAMES} vs "
                      f"{tuple(n for n, _ in _lib.fg_loss_config._fields_)}")


def loss_options_of(arguments: dict) -> dict:
    """The loss options among a front end's keyword arguments, every one a known
    option (an unknown name raises TypeError, as an unexpected keyword does)."""
    unknown = sorted(set(arguments) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the "
                        f"loss options are {', '.join(OPTION_NAMES)}")
    return dict(arguments)


def loss_config(options: dict) -> _lib.fg_loss_config:
    """The fg_loss_config of these loss options (missing ones take their
    defaults), every value checked against its range."""
    options = loss_options_of(options)
    cfg = _lib.fg_loss_config()
    for o in _OPTIONS:
        setattr(cfg, o.name, o.check(o.name, options.get(o.name, o.default)))
    return cfg


def config_bytes(cfg: _lib.fg_loss_config) -> np.ndarray:
    """The struct's bytes, as the JAX FFI handler takes them (one uint8 array
    attribute, copied into its fg_loss_config). For a loss_config: equal
    options, however spelled (0 or 0.0 or -0.0, True or 1, a default given or
    left out), give equal bytes (the padding is ctypes' zeroed memory)."""
    return np.frombuffer(ctypes.string_at(ctypes.addressof(cfg), ctypes.sizeof(cfg)),
                         np.uint8).copy()


# ------------------------------------------------------------------ execution

def check_threads(threads) -> int:
    """fg_exec.threads of a front end's ``threads``: None is the library's default
    (0), else an integer in [1, MAX_THREADS]."""
    if threads is None:
        return 0
    if (isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral)
            or not 1 <= int(threads) <= MAX_THREADS):
        _fail("threads", f"an integer in [1, {MAX_THREADS}] (or None: OpenMP's default)",
              threads)
    return int(threads)


def check_memory_budget(memory_budget) -> int:
    """fg_exec.memory_budget of a front end's ``memory_budget``: None is the
    library's default (0), else a number of bytes in [1, 2**63 - 1]."""
    if memory_budget is None:
        return 0
    if (isinstance(memory_budget, (bool, np.bool_))
            or not isinstance(memory_budget, numbers.Integral)
            or not 1 <= int(memory_budget) <= MAX_MEMORY_BUDGET):
        _fail("memory_budget", "an integer number of bytes in [1, 2**63 - 1] (or None: the "
              "default: 256 MiB on the CPU, 2 GiB on CUDA)", memory_budget, "FG_ERR_INVALID_SIZE")
    return int(memory_budget)


def make_exec(threads=None, memory_budget=None) -> _lib.fg_exec:
    """The per-call fg_exec of a front end's threads and memory_budget (checked)."""
    ex = _lib.fg_exec()
    _lib.lib.fg_exec_init(ctypes.byref(ex))
    ex.threads = check_threads(threads)
    ex.memory_budget = check_memory_budget(memory_budget)
    return ex


# ------------------------------------------------------------------ signatures

def with_loss_options(fn):
    """fn takes the loss options as ``**options``; its signature (help(),
    inspect, IDEs) lists each of them as a keyword-only parameter with its
    default, in place of ``**options``."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default)
               for o in _OPTIONS]
    fn.__signature__ = sig.replace(parameters=params)
    return fn
