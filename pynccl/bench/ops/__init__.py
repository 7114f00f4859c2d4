"""One small file per collective; this maps the CLI's OP names to them, in nccl-tests' order."""
from .all_gather import AllGather
from .all_reduce import AllReduce
from .alltoall import AllToAll
from .base import Collective
from .broadcast import Broadcast
from .gather import Gather
from .reduce import Reduce
from .reduce_scatter import ReduceScatter
from .scatter import Scatter
from .sendrecv import SendRecv

OPS = {op.name: op for op in (AllReduce(), AllGather(), ReduceScatter(), Broadcast(), Reduce(),
                              AllToAll(), SendRecv(), Gather(), Scatter())}
OP_NAMES = list(OPS)


def get_op(name: str) -> Collective:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown OP {name!r}; expected one of {', '.join(OP_NAMES)}") from None
