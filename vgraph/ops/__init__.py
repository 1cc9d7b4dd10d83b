"""Op registry and the built-in catalog."""
from .registry import REGISTRY, InferCtx, OpDef, OpRegistry, get_op, register_op, same_as_input
from .schema import COMMON_FIELDS, ConfigError, F, Field, Schema
from . import catalog as _catalog  # noqa: F401  (registers the built-in types)
from . import boundary as _boundary  # noqa: F401  (send / receive / weight_replica of partitioned parts)

__all__ = ["REGISTRY", "InferCtx", "OpDef", "OpRegistry", "get_op", "register_op", "same_as_input",
           "COMMON_FIELDS", "ConfigError", "F", "Field", "Schema"]
