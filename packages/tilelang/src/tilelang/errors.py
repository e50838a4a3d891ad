"""Errors raised by the tile compiler. Front-end errors cite the user's file:line and code."""

from __future__ import annotations

from dataclasses import dataclass

import tilehal


@dataclass(frozen=True)
class SourceLoc:
    """Where an IR node came from in the user's Python source."""

    filename: str
    lineno: int
    code: str = ""

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"


class CompileError(tilehal.CompileError):
    """A tile program is malformed; `loc` (when known) points at the offending source line."""

    def __init__(self, message: str, loc: SourceLoc | None = None, log: str = "") -> None:
        self.loc = loc
        self.message = message
        if loc is not None:
            text = f"{loc}: {message}"
            if loc.code:
                text += f"\n    {loc.code.strip()}"
        else:
            text = message
        super().__init__(text, log=log)
