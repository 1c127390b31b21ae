"""Type aliases shared by the package."""

from typing import Any

# A nested structure of arrays (params, optimizer states, batches).
PyTree = Any
