"""Exceptions raised by pynccl, shared by both backends and by the C++ extension.

The C++ side translates its failures into these classes (it imports this module
when it throws), so callers catch one hierarchy whichever backend ran the op.
"""


class PyncclError(RuntimeError):
    """An NCCL, CUDA or communication failure (not bad input: that is ValueError/TypeError)."""


# The exit status of a process that pynccl ended on an NCCL time-out (the default; see
# CommTimeoutError). EX_TEMPFAIL of sysexits.h: a launcher can tell it from a crash and retry.
TIMEOUT_EXIT_CODE = 75


class CommTimeoutError(PyncclError):
    """A wait ran past its group's timeout; the communicator has been aborted.

    On the nccl backend this is raised only with on_timeout="raise" (PYNCCL_ON_TIMEOUT=raise); by
    default a time-out ends the process with TIMEOUT_EXIT_CODE after writing the flight record
    and one message to stderr, so that no output of an unfinished op is ever used as a result."""


class PacingTimeoutError(PyncclError, TimeoutError):
    """ZeRO-3's backward waited on the host for its own GPU to reach an earlier block's backward
    past twice its group's timeout (zero/backward_pacing.py); nothing was aborted."""


class CollectiveMismatchError(PyncclError):
    """Ranks of one group called different collectives (op, dtype, count, root or sequence number)."""


class ShardedParameterError(RuntimeError):
    """A ZeRO-3 sharded parameter was used outside the forward of its unit, where its module
    attribute holds no values (zero/placeholder.py); not a communication failure."""
