"""Optimizer options: Kaldi's ``NnetOptimizeOptions`` (nnet-optimize.h).

One frozen dataclass, one field per Kaldi option, same names in snake_case and
the same defaults.  ``optimize_looped_computation`` is Kaldi's hidden option
(set by the looped compiler, never from the command line).  Two fields are
ours and do not change the result of optimization:

- ``check_after_each_pass``: run the ComputationChecker after every pass (what
  Kaldi does at verbose level >= 3); a failure names the pass at fault and the
  passes that ran before it.  Used by tests and debugging.

``cache_key()`` is a canonical text of every field that changes the optimized
computation, so that computations optimized under different options never share
a cache entry (the service folds it, with the IR version, into its cache key).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.core.errors import ConfigError
from engine.core.index import INT32_MAX, INT32_MIN

# bump when a pass changes its output for the same options (part of the cache key)
OPTIMIZER_VERSION = 2   # 2: no-ops of remove_unnecessary_zeroing kept without allocate_from_other


@dataclass(frozen=True)
class OptimizeOptions:
    optimize: bool = True
    consolidate_model_update: bool = True
    propagate_in_place: bool = True
    backprop_in_place: bool = True
    optimize_row_ops: bool = True
    split_row_ops: bool = True
    extend_matrices: bool = True
    convert_addition: bool = True
    remove_assignments: bool = True
    allow_left_merge: bool = True
    allow_right_merge: bool = True
    initialize_undefined: bool = True
    move_sizing_commands: bool = True
    allocate_from_other: bool = True
    # std::numeric_limits<int32>::min() / max(): Kaldi's "not set" for the deriv-times
    min_deriv_time: int = INT32_MIN
    max_deriv_time: int = INT32_MAX
    max_deriv_time_relative: int = INT32_MAX
    snip_row_ops: bool = True
    memory_compression_level: int = 1
    optimize_looped_computation: bool = False
    # ours: debugging aid, does not change the result
    check_after_each_pass: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(v, bool):
                    raise ConfigError(f"optimizer option {f.name}: expected a boolean, "
                                      f"got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"optimizer option {f.name}: expected an integer, got {v!r}")
        if not 0 <= self.memory_compression_level <= 3:
            raise ConfigError("optimizer option memory_compression_level: expected 0..3, "
                              f"got {self.memory_compression_level}")
        for name in ("min_deriv_time", "max_deriv_time", "max_deriv_time_relative"):
            v = getattr(self, name)
            if not INT32_MIN <= v <= INT32_MAX:
                raise ConfigError(f"optimizer option {name}: expected a 32-bit integer, "
                                  f"got {v}")
        self.check_deriv_times(None)

    def check_deriv_times(self, max_output_time: int | None) -> None:
        """The derivative-time window is not empty (Kaldi asserts it): a ConfigError
        naming the options otherwise.  With max_deriv_time_relative set, the window's
        end depends on the request (its largest output t): unchecked while that is
        None."""
        if self.max_deriv_time_relative != INT32_MAX:
            if max_output_time is None:
                return
            hi = self.max_deriv_time_relative + max_output_time
            what = (f"max_deriv_time_relative {self.max_deriv_time_relative} + the "
                    f"request's largest output t {max_output_time} = {hi}")
        else:
            hi, what = self.max_deriv_time, f"max_deriv_time {self.max_deriv_time}"
        if hi < self.min_deriv_time:
            raise ConfigError(f"optimizer option min_deriv_time {self.min_deriv_time}: more "
                              f"than {what} (no time left to compute derivatives at)")

    # -- derived -------------------------------------------------------------------------
    def effective_max_deriv_time(self, max_output_time: int | None) -> int:
        """max_deriv_time, or max_deriv_time_relative plus the largest output t of the
        request when the relative form is set (as Kaldi's Optimize())."""
        if self.max_deriv_time_relative != INT32_MAX:
            if max_output_time is None:
                raise ConfigError("optimizer option max_deriv_time_relative needs the "
                                  "computation request (its largest output t)")
            return self.max_deriv_time_relative + max_output_time
        return self.max_deriv_time

    def replace(self, **changes) -> "OptimizeOptions":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "OptimizeOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown optimizer option(s): {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def result_fields(cls) -> list[str]:
        """The fields that can change the optimized computation (all but the
        debugging switch)."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "check_after_each_pass"]

    def cache_key(self) -> str:
        """Canonical text: version, then name=value for each result field in a fixed
        (declaration) order; booleans as 0/1."""
        parts = [f"v{OPTIMIZER_VERSION}"]
        for name in self.result_fields():
            v = getattr(self, name)
            parts.append(f"{name}={int(v) if isinstance(v, bool) else v}")
        return ";".join(parts)


# The default options, made once: the instance is frozen, and the compile path would
# otherwise build and check a new one (two per compile, ~15 us each) for every request.
DEFAULT_OPTIONS = OptimizeOptions()
