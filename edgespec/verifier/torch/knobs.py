"""Kernel knobs: the constants that choose between measured GPU kernel variants, set by name.

The variants live next to their kernels as class or module constants (TritonPagedAttention.TREE_SPLIT,
fused.GEMV_ROPE, tree_ops.MOVE_ROWS_KERNEL, pdl.PDL, tile sizes, split policy). Their defaults are what the
H200 runs measured fastest (docs/BENCHMARKS.md). An operator whose GPU differs, and the benchmarks
that A/B the variants, set them here by name instead of editing the code:

    EDGESPEC_KERNEL_KNOBS="GEMV_ROPE=1,TREE_SPLIT=1" edgespec verifier serve --backend torch --device cuda

The variable is read once, when the engine module is first imported (engine.py imports this module);
in-process overrides (`override`) win. A name no kernel has is an error, not a silent no-op.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping

ENV = "EDGESPEC_KERNEL_KNOBS"


def _owners() -> tuple[object, ...]:
    """The kernels' homes, imported only when a knob is named: with no knobs set, importing the engine
    does not load fused.py (the model imports it when the fused forward first runs)."""
    from edgespec.verifier.torch import fused, pdl, tree_ops

    try:
        from edgespec.verifier.torch.triton_attention import TritonPagedAttention
    except ImportError:   # a CPU install without triton: only the torch fallbacks' knobs exist
        return (fused, tree_ops, pdl)
    return (TritonPagedAttention, fused, tree_ops, pdl)


def _is_knob(name: str, value: object) -> bool:
    """A knob is a public upper-case integer constant of a kernel's home."""
    return name.isupper() and not name.startswith("_") and isinstance(value, int) and not isinstance(value, bool)


def _owner(name: str) -> object:
    """Where knob `name` lives; a ValueError names the knob when none has it (a typo is not ignored)."""
    for owner in _owners():
        if _is_knob(name, getattr(owner, name, None)):
            return owner
    raise ValueError(f"no kernel knob {name!r} (knobs are integer constants of TritonPagedAttention, "
                     "fused, tree_ops or pdl)")


def home(name: str) -> str:
    """The kernel home of knob `name`: 'TritonPagedAttention', 'fused', 'tree_ops' or 'pdl' (a tool can then
    tell a knob that only changes the attention's launch from one that changes other kernels)."""
    return _owner(name).__name__.rsplit(".", 1)[-1]


def parse(spec: str) -> dict[str, int]:
    """'KNOB=V,KNOB=V' (':' separates too) as {knob: int value}; '' -> {}. Unknown knobs and
    non-integer values are ValueErrors."""
    values: dict[str, int] = {}
    for item in spec.replace(":", ",").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"kernel knob {item!r} is not NAME=VALUE")
        _owner(name)
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"kernel knob {name} needs an integer, got {value!r}") from None
    return values


def current(names: Iterable[str] | None = None) -> dict[str, int]:
    """The values in effect now of the knobs `names` (default: every knob), for logs and benchmark
    records: a result then says which kernel variants ran, defaults included."""
    if names is None:
        names = sorted({k for owner in _owners() for k, v in vars(owner).items() if _is_knob(k, v)})
    return {k: int(getattr(_owner(k), k)) for k in names}


def set_knobs(values: Mapping[str, int]) -> dict[str, int]:
    """Set knobs; returns their previous values (so a caller can put them back)."""
    owners = {k: _owner(k) for k in values}   # all checked before any is set
    before = {k: getattr(owners[k], k) for k in values}
    for k, v in values.items():
        setattr(owners[k], k, int(v))
    return before


@contextmanager
def override(values: Mapping[str, int]) -> Iterator[None]:
    """Knobs set for the body, then put back as they were (benchmarks timing variants in one process)."""
    before = set_knobs(values)
    try:
        yield
    finally:
        set_knobs(before)


def apply_env(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """Set the knobs named in $EDGESPEC_KERNEL_KNOBS; returns what it set."""
    values = parse(environ.get(ENV, ""))
    set_knobs(values)
    return values


FROM_ENV = apply_env()
