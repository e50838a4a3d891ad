"""Python AST -> tile IR."""

from .parser import parse_prim_func

__all__ = ["parse_prim_func"]
