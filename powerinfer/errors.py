"""Project exceptions. The CLI turns any PowerInferError into one line on stderr and exit code 1."""


class PowerInferError(Exception):
    """Base class of every error the library raises on purpose."""


class FormatError(PowerInferError):
    """A model or index file is malformed, truncated or of an unsupported kind."""


class ConfigError(PowerInferError):
    """Metadata is missing a required key or holds an unusable value."""


class PlacementError(PowerInferError):
    """A VRAM budget or device placement cannot be satisfied."""


class InputError(PowerInferError):
    """User input (prompt, flags) cannot be processed, e.g. a prompt longer than the context."""


class DistributedError(PowerInferError):
    """A pipeline rank died, cannot be reached or disagrees with the others (runtime.pipeline)."""
