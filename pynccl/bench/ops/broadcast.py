"""broadcast: root's input reaches every rank; busbw = algbw.

The API broadcasts in place; out-of-place copies root's input into its output first.
"""
import functools

from .base import Collective, Counts, Segment


class Broadcast(Collective):
    name = "broadcast"
    has_root = True

    def counts(self, count, nranks, elem_size):
        return Counts(send=count, recv=count, param=count)

    def bus_factor(self, nranks):
        return 1.0

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.recv, root, 0)]

    def make_call(self, impl, send, recv, in_place, spec):
        broadcast, root, group = impl.api.broadcast, spec.root, impl.group
        if in_place or spec.rank != root:
            return functools.partial(broadcast, recv, root, group)
        copy = recv.copy_

        def out_of_place():
            copy(send)
            broadcast(recv, root, group)
        return out_of_place
