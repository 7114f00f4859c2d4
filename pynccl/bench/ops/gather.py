"""gather: rank s's c elements land at s·c on root (other ranks receive nothing);
busbw = algbw × (n-1)/n. In place, each rank's input is its own chunk of root's output."""
import functools

from .base import Collective, Segment, gathering_counts


class Gather(Collective):
    name = "gather"
    has_root = True

    def counts(self, count, nranks, elem_size):
        return gathering_counts(count, nranks, elem_size)

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def expected(self, rank, nranks, root, counts):
        c = counts.param
        return [Segment(s * c, c, s, 0) for s in range(nranks)] if rank == root else []

    def make_call(self, impl, send, recv, in_place, spec):
        c = spec.counts.param
        gather_list = [recv[s * c:(s + 1) * c] for s in range(spec.nranks)] if spec.rank == spec.root else None
        return functools.partial(impl.api.gather, send, gather_list, spec.root, impl.group)
