"""Attention head types. Importing this package registers every type under its config name."""
from heads import dense  # noqa: F401  (one import per head type registers it)
from heads import mosaic  # noqa: F401
from heads import mosa  # noqa: F401
from heads import fixed  # noqa: F401
from heads import local  # noqa: F401
from heads import routing_attn  # noqa: F401
from heads import topk  # noqa: F401
from heads import agent  # noqa: F401
from heads import mita  # noqa: F401
from heads.base import (REGISTRY, ConfigError, GroupContext, HeadGroup, HeadOptions, commit_states, head_class,
                        make_options, register)

__all__ = ["REGISTRY", "ConfigError", "GroupContext", "HeadGroup", "HeadOptions", "commit_states", "head_class", "make_options",
           "register"]
