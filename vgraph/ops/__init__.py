"""Op registry and the built-in catalog."""
from vgraph.ops import catalog as _catalog  # noqa: F401  (registers the built-in types)
from vgraph.ops import boundary as _boundary  # noqa: F401  (send / receive / weight_replica of partitioned parts)
from vgraph.ops.registry import REGISTRY, InferCtx, OpDef, OpExample, OpRegistry, get_op, register_op, same_as_input
from vgraph.ops.schema import COMMON_FIELDS, ConfigError, F, Field, Schema

__all__ = ["REGISTRY", "InferCtx", "OpDef", "OpExample", "OpRegistry", "get_op", "register_op", "same_as_input",
           "COMMON_FIELDS", "ConfigError", "F", "Field", "Schema"]
