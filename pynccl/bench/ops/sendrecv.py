"""sendrecv: each rank sends N elements to rank+1 and receives from rank-1 in one grouped
call; busbw = algbw. In-place results are undefined (N/A), as in nccl-tests."""
from .base import Collective, Segment, whole_counts


class SendRecv(Collective):
    name = "sendrecv"
    in_place_checked = False

    def counts(self, count, nranks, elem_size):
        return whole_counts(count)

    def bus_factor(self, nranks):
        return 1.0

    def expected(self, rank, nranks, root, counts):
        return [Segment(0, counts.recv, (rank - 1) % nranks, 0)]

    def make_call(self, impl, send, recv, in_place, spec):
        api, rank, n = impl.api, spec.rank, spec.nranks
        ops = [api.P2POp(api.isend, send, (rank + 1) % n, impl.group),
               api.P2POp(api.irecv, recv, (rank - 1) % n, impl.group)]
        batch_isend_irecv = api.batch_isend_irecv

        def sendrecv():
            for work in batch_isend_irecv(ops):
                work.wait()
        return sendrecv
