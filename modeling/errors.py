"""The named errors of model configuration and checkpoint loading (a leaf module: everything in `modeling` may
import it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A model or generation config is missing a field, has a wrong type, or is inconsistent. The message names
    the field."""


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor or a file, has an unexpected one, or one of the wrong shape. The message
    names the tensor or the file."""
