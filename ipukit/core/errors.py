"""The ipukit error family: every error a user can provoke is an :class:`Error`.

Subclasses also derive from the built-in exception PopTorch raised in the same situation
(``AttributeError``, ``ValueError``), so code written against PopTorch keeps working;
messages name the option, the value and the fix.
"""
import contextlib


class Error(RuntimeError):
    """Base class of every error raised by ipukit."""


class OptionsError(Error, ValueError):
    """An option has a value ipukit cannot use."""


class ConfigFileError(OptionsError):
    """A line of an options config file (or JSON) that is not a setter call ipukit can read."""


class FrozenOptionsError(Error, AttributeError):
    """Options were modified after being handed to a model or DataLoader."""


class UnknownOptionError(Error, AttributeError):
    """An option (method or attribute) that neither PopTorch nor ipukit defines."""


class BatchSizeError(Error, ValueError):
    """An input's batch dimension does not fit the combined batch size."""


class InputShapeError(Error, ValueError):
    """A compiled model was called with inputs of another shape or structure."""


class PipelineConfigError(Error, ValueError):
    """Stages, blocks and batching options that cannot be combined."""


class BlockError(Error):
    """A Block annotation that cannot be mapped onto stages."""


class TracingError(Error):
    """The model could not be traced and split into stages."""


class OperationError(Error, ValueError):
    """A PopTorch operation (``for_loop``, ``dynamic_slice``, ...) got arguments it cannot use."""


class UnsupportedError(Error, NotImplementedError):
    """A PopTorch feature that needs IPU hardware or the Poplar SDK."""


class ModelStateError(Error):
    """A model method was called in a state that does not allow it."""


class DataError(Error):
    """A dataset could not be found or loaded."""


class LossError(Error, ValueError):
    """The model's loss cannot be trained on (not a scalar, no loss output)."""


class LoaderLengthError(Error, TypeError):
    """``len()`` of a loader whose dataset or batch sampler has no length (a ``TypeError``, as
    Python's ``len()`` raises, so ``list(loader)`` still works)."""


class StallError(Error):
    """A call that made no progress for ``Options.stallTimeout`` seconds, stopped and undone. The
    message names each worker's last action and what it waits for; ``stuck`` lists the workers
    still inside a user's operation (which cannot be stopped from outside)."""

    def __init__(self, message: str, stuck=()) -> None:
        super().__init__(message)
        self.stuck = list(stuck)


class MissingExtraError(Error, ImportError):
    """A part of ipukit whose optional dependencies (an extra) are not installed."""


@contextlib.contextmanager
def needs_extra(extra: str, where: str):
    """Around an optional import: a missing package becomes an error naming the extra.

    >>> with needs_extra("viz", "ipukit.viz.plots"):
    ...     import plotly.graph_objects as go
    """
    try:
        yield
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "a package"
        raise MissingExtraError(
            f"{where} needs {missing}, which is not installed. Install the extra: "
            f'pip install "ipukit[{extra}]"') from exc
