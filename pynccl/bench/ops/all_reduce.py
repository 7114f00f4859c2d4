"""all_reduce: every rank ends with the reduction of all inputs; busbw = algbw × 2(n-1)/n.

The API (like torch.distributed's) reduces in place, so out-of-place is a copy of the input into
the output followed by the in-place all_reduce; the same for both implementations.
"""
import functools

from .base import ALL, Collective, Counts, Segment


class AllReduce(Collective):
    name = "all_reduce"
    has_redop = True

    def counts(self, count, nranks, elem_size):
        return Counts(send=count, recv=count, param=count)

    def bus_factor(self, nranks):
        return 2 * (nranks - 1) / nranks

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.recv, ALL, 0)]

    def make_call(self, impl, send, recv, in_place, spec):
        all_reduce, op, group = impl.api.all_reduce, spec.redop, impl.group
        if in_place:
            return functools.partial(all_reduce, recv, op, group)
        copy = recv.copy_

        def out_of_place():
            copy(send)
            all_reduce(recv, op, group)
        return out_of_place
