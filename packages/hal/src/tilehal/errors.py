"""One exception hierarchy for the whole stack.

Messages name the argument, what was expected and what was found, so a newcomer can act on
them without reading our source.
"""

from __future__ import annotations


class TileStackError(Exception):
    """Base of every error raised by TileStack packages."""


class CompileError(TileStackError):
    """A C or CUDA compile failed; `log` holds the compiler's own output."""

    def __init__(self, message: str, log: str = "", source_name: str = "") -> None:
        self.log = log
        self.source_name = source_name
        full = message if not log else f"{message}\n--- compiler log ---\n{log.rstrip()}"
        super().__init__(full)


class LaunchError(TileStackError):
    """A kernel launch was refused or failed."""


class ShapeError(TileStackError, ValueError):
    """A tensor argument has the wrong shape, dtype, layout, alignment or device."""


class DeviceError(TileStackError):
    """The requested device is missing or cannot do what was asked."""


class ArgumentError(TileStackError, ValueError, TypeError):
    """A non-tensor argument has the wrong type or is outside its valid range."""


class CacheError(TileStackError, OSError):
    """The compile cache is unsafe to use (foreign owner, symlink, bad key file) or a lock wait ran out."""


class CommTimeoutError(TileStackError, TimeoutError):
    """A communication wait ran past its deadline (dead or stuck peer). `rank`: the reporting rank;
    `stage`: what it was doing; `peer`: the rank (of the group) that stopped answering, when known."""

    def __init__(self, message: str, rank: int | None = None, stage: str | None = None,
                 peer: int | None = None) -> None:
        self.rank = rank
        self.stage = stage
        self.peer = peer
        super().__init__(message)


def expect(condition: bool, arg: str, expected: object, actual: object, kind: type = ShapeError) -> None:
    """Raise `kind` with the stack's standard message unless `condition` holds."""
    try:
        ok = bool(condition)
    except (TypeError, ValueError, RuntimeError):  # an array or tensor with several elements
        raise ArgumentError(f"expect({arg!r}): expected condition a bool, got {type(condition).__name__}") from None
    if not ok:
        raise kind(f"{arg}: expected {expected}, got {actual}")


def check_int(value: object, arg: str, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi] (either bound optional); a float, a bool, a non-number or a value
    outside the bounds raises ArgumentError naming `arg`. Integers of any kind (numpy, 0-d tensors) pass."""
    import operator

    for bound, bname in ((lo, "lo"), (hi, "hi")):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise ArgumentError(f"check_int({arg!r}): expected {bname} an int or None, got {bound!r}")
    want = "an integer" + (f" >= {lo}" if lo is not None and hi is None else "") + (
        f" in [{lo}, {hi}]" if lo is not None and hi is not None else "") + (
        f" <= {hi}" if hi is not None and lo is None else "")
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ArgumentError(f"{arg}: expected {want}, got {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ArgumentError(f"{arg}: expected {want}, got {v}")
    return v


def check_choice(value: object, arg: str, choices: tuple | list) -> object:
    """`value` if it is one of `choices` (strings, numbers, None), else ArgumentError naming `arg`. A value of
    another type (an array, a list) is refused without comparing it, so it cannot raise a library error."""
    if not isinstance(choices, (tuple, list)) or not choices:
        raise ArgumentError(f"check_choice({arg!r}): expected choices a non-empty tuple or list, got {choices!r}")
    ok_types = tuple({type(c) for c in choices})
    if isinstance(value, ok_types) and not (isinstance(value, bool) and bool not in ok_types) and value in choices:
        return value
    shown = ", ".join(repr(c) for c in choices)
    raise ArgumentError(f"{arg}: expected one of {shown}, got {value!r}"[:400])
