"""all_reduce: every rank ends with the reduction of all inputs; busbw = algbw × 2(n-1)/n.
pynccl's out-of-place row is one NCCL call (backend output=); torch's API is in-place only,
so its row copies the input in first."""
import functools

from .base import out_of_place_call, ALL, Collective, Segment, copy_then, whole_counts


class AllReduce(Collective):
    name = "all_reduce"
    has_redop = True

    def counts(self, count, nranks, elem_size):
        return whole_counts(count)

    def bus_factor(self, nranks):
        return 2 * (nranks - 1) / nranks

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.recv, ALL, 0)]

    def make_call(self, impl, send, recv, in_place, spec):
        args = (recv, spec.redop, impl.group)
        if in_place:
            return functools.partial(impl.api.all_reduce, *args)
        return (out_of_place_call(impl, "all_reduce", send, recv, spec.redop, False)
                or copy_then(send, recv, impl.api.all_reduce, *args))
