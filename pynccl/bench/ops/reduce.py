"""reduce: root ends with the reduction of all inputs (other ranks' outputs are not checked);
busbw = algbw. The API reduces in place: out-of-place copies the input in first."""
import functools

from .base import ALL, Collective, Segment, copy_then, whole_counts


class Reduce(Collective):
    name = "reduce"
    has_redop = True
    has_root = True

    def counts(self, count, nranks, elem_size):
        return whole_counts(count)

    def bus_factor(self, nranks):
        return 1.0

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.recv, ALL, 0)] if rank == root else []

    def make_call(self, impl, send, recv, in_place, spec):
        args = (recv, spec.root, spec.redop, impl.group)
        if in_place:
            return functools.partial(impl.api.reduce, *args)
        return copy_then(send, recv, impl.api.reduce, *args)
