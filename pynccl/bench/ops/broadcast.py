"""broadcast: root's input reaches every rank; busbw = algbw.
pynccl's out-of-place row is one NCCL call (backend output=); torch's API is in-place, so
root copies its input into its output first."""
import functools

from .base import out_of_place_call, Collective, Segment, copy_then, whole_counts


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
        if in_place:
            return functools.partial(impl.api.broadcast, *args)
        # pynccl: one ncclBroadcast(send, recv) on every rank; torch: root copies, then in-place.
        direct = out_of_place_call(impl, "broadcast", send, recv, spec.root, False)
        if direct is not None:
            return direct
        if spec.rank != spec.root:
            return functools.partial(impl.api.broadcast, *args)
        return copy_then(send, recv, impl.api.broadcast, *args)
