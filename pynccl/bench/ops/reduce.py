"""reduce: root ends with the reduction of all inputs (other ranks' outputs are not checked);
busbw = algbw. pynccl's out-of-place row is one NCCL call (backend output=); torch's API is in-place, so
its row copies the input in first."""
import functools

from .base import out_of_place_call, ALL, Collective, Segment, copy_then, whole_counts


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
        return (out_of_place_call(impl, "reduce", send, recv, spec.root, spec.redop, False)
                or copy_then(send, recv, impl.api.reduce, *args))
