"""reduce_scatter: rank r gets chunk r (c elements) of the reduction of all n·c-element inputs;
busbw = algbw × (n-1)/n. In place, the output is the rank's own chunk of the input."""
import functools

from .base import ALL, Collective, Segment, scattering_counts


class ReduceScatter(Collective):
    name = "reduce_scatter"
    has_redop = True

    def counts(self, count, nranks, elem_size):
        return scattering_counts(count, nranks, elem_size)

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.param, ALL, rank * counts.param)]

    def make_call(self, impl, send, recv, in_place, spec):
        return functools.partial(impl.api.reduce_scatter_tensor, recv, send, spec.redop, impl.group)
