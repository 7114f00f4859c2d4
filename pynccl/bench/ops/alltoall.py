"""alltoall: chunk r of rank s's input lands at chunk s of rank r's output (c elements per
peer); busbw = algbw × (n-1)/n. In-place results are undefined (N/A), as in nccl-tests."""
import functools

from .base import Collective, Counts, Segment, per_rank_count


class AllToAll(Collective):
    name = "alltoall"
    in_place_checked = False

    def counts(self, count, nranks, elem_size):
        c = per_rank_count(count, nranks, elem_size)
        return Counts(send=c * nranks, recv=c * nranks, param=c)

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def expected(self, rank, nranks, root, counts):
        c = counts.param
        return [Segment(s * c, c, s, rank * c) for s in range(nranks)]

    def make_call(self, impl, send, recv, in_place, spec):
        return functools.partial(impl.api.all_to_all_single, recv, send, None, None, impl.group)
