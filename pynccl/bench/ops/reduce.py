"""reduce: root ends with the reduction of all inputs (other ranks' outputs are not checked);
busbw = algbw. The API reduces in place; out-of-place copies the input into the output first.
"""
import functools

from .base import ALL, Collective, Counts, Segment


class Reduce(Collective):
    name = "reduce"
    has_redop = True
    has_root = True

    def counts(self, count, nranks, elem_size):
        return Counts(send=count, recv=count, param=count)

    def bus_factor(self, nranks):
        return 1.0

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.recv, ALL, 0)] if rank == root else []

    def make_call(self, impl, send, recv, in_place, spec):
        reduce, root, op, group = impl.api.reduce, spec.root, spec.redop, impl.group
        if in_place:
            return functools.partial(reduce, recv, root, op, group)
        copy = recv.copy_

        def out_of_place():
            copy(send)
            reduce(recv, root, op, group)
        return out_of_place
