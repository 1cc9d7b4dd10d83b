"""Tensor types carried by IR slots: a per-sample shape and a dtype.

Shapes never include the batch dimension (the network YAML convention).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "string": 0}


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def kind(self) -> str:
        """'float', 'int' or 'str': what an input slot can demand of an edge."""
        if self.dtype in FLOAT_DTYPES:
            return "float"
        return "int" if self.dtype == "int64" else "str"

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def with_shape(self, shape: tuple[int, ...]) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


class ShapeError(ValueError):
    """Raised by an op's inference rule; the message names what disagrees."""
