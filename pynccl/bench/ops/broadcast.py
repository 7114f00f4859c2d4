"""broadcast: root's input reaches every rank; busbw = algbw.
The API broadcasts in place: out-of-place copies root's input into its output first."""
import functools

from .base import Collective, Segment, copy_then, whole_counts


class Broadcast(Collective):
    name = "broadcast"
    has_root = True

    def counts(self, count, nranks, elem_size):
        return whole_counts(count)

    def bus_factor(self, nranks):
        return 1.0

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.recv, root, 0)]

    def make_call(self, impl, send, recv, in_place, spec):
        args = (recv, spec.root, impl.group)
        if in_place or spec.rank != spec.root:
            return functools.partial(impl.api.broadcast, *args)
        return copy_then(send, recv, impl.api.broadcast, *args)
