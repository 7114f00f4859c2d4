"""scatter: chunk r (c elements) of root's input lands on rank r; busbw = algbw × (n-1)/n.
In place, each rank's output is its own chunk of root's input."""
import functools

from .base import Collective, Segment, scattering_counts


class Scatter(Collective):
    name = "scatter"
    has_root = True

    def counts(self, count, nranks, elem_size):
        return scattering_counts(count, nranks, elem_size)

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.param, root, rank * counts.param)]

    def make_call(self, impl, send, recv, in_place, spec):
        c = spec.counts.param
        scatter_list = [send[s * c:(s + 1) * c] for s in range(spec.nranks)] if spec.rank == spec.root else None
        return functools.partial(impl.api.scatter, recv, scatter_list, spec.root, impl.group)
