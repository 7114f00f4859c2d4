"""Exceptions raised by pynccl, shared by both backends and by the C++ extension.

The C++ side translates its failures into these classes (it imports this module
when it throws), so callers catch one hierarchy whichever backend ran the op.
"""


class PyncclError(RuntimeError):
    """An NCCL, CUDA or communication failure (not bad input: that is ValueError/TypeError)."""


class CommTimeoutError(PyncclError):
    """A blocking wait ran past its group's timeout; the communicator has been aborted."""


class CollectiveMismatchError(PyncclError):
    """Ranks of one group called different collectives (op, dtype, count, root or sequence number)."""
