"""The tile IR: nodes (expressions, buffers, statements, tile ops), layouts, dtypes, the printer,
the verifier and the walkers. Importing the package registers the printer behind
`PrimFunc.script()` (nodes itself imports no printer: the dependency points one way)."""

from . import printer as _printer  # noqa: F401 - registers PrimFunc.printer
