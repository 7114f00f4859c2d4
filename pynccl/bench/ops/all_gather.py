"""all_gather: rank s's c elements land at s·c on every rank; busbw = algbw × (n-1)/n.
In place, each rank's input is its own chunk of the output."""
import functools

from .base import Collective, Segment, gathering_counts


class AllGather(Collective):
    name = "all_gather"

    def counts(self, count, nranks, elem_size):
        return gathering_counts(count, nranks, elem_size)

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def expected(self, rank, nranks, root, counts):
        c = counts.param
        return [Segment(s * c, c, s, 0) for s in range(nranks)]

    def make_call(self, impl, send, recv, in_place, spec):
        return functools.partial(impl.api.all_gather_into_tensor, recv, send, impl.group)
