"""The "gloo" backend: torch.distributed's gloo process group on CPU tensors.

It exists so that every feature runs, and is tested, on machines with no GPU. Where gloo
lacks an op or a reduction (AVG, PREMUL_SUM, reduce_scatter), it is composed from ops
gloo has; gloo's own errors are turned into pynccl's (a time-out into CommTimeoutError).
"""
from __future__ import annotations

import contextlib
import datetime
from typing import List

import torch
import torch.distributed as tdist

from ...errors import CommTimeoutError, PyncclError
from ..flight_recorder import FlightRecorder
from ..members_only_groups import new_members_only_group
from ..reduce_op import PremulSum, ReduceOp, as_reduce_op, check_op_for_dtype
from .base import Backend
from .gloo_work import GlooWork

_CPU = torch.device("cpu")
_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                     torch.int8, torch.uint8, torch.int32, torch.int64)
_NATIVE_OPS = {ReduceOp.SUM: tdist.ReduceOp.SUM, ReduceOp.PRODUCT: tdist.ReduceOp.PRODUCT,
               ReduceOp.MAX: tdist.ReduceOp.MAX, ReduceOp.MIN: tdist.ReduceOp.MIN,
               ReduceOp.AVG: tdist.ReduceOp.SUM, ReduceOp.PREMUL_SUM: tdist.ReduceOp.SUM,
               ReduceOp.BAND: tdist.ReduceOp.BAND, ReduceOp.BOR: tdist.ReduceOp.BOR, ReduceOp.BXOR: tdist.ReduceOp.BXOR}


def _connected(pg) -> None:
    """Returns once every member of a new gloo group has finished connecting to the others. NOTE:
    gloo's connectFullMesh can return on one rank while a peer is still completing its side; a
    group destroyed at once (new_group then destroy_process_group) then closed that peer's socket
    under it ("Connection closed by peer", tests/test_errors.py in CI, session 15)."""
    tdist.barrier(group=pg)


class GlooBackend(Backend):
    name = "gloo"

    def __init__(self, pg, rank: int, world_size: int, timeout_s: float, group_name: str, owns_pg: bool = True):
        self.pg = pg
        self.owns_pg = owns_pg       # False for a torch group the user made (torch_interop.py): never destroyed here
        self.rank = rank
        self.world_size = world_size
        self.device = _CPU
        self.timeout_s = timeout_s
        self.group_name = group_name
        self.seq = 0
        self._destroyed = False
        self.recorder = FlightRecorder()
        # torch works of p2p ops handed out one per op that nobody may wait for (a script that waits
        # only for its receive, as torch users do): kept until they complete, since a dropped gloo
        # send work cancels the send and its peer's receive would never complete.
        self._unwaited: list = []

    @classmethod
    def from_default_group(cls, timeout_s: float) -> "GlooBackend":
        pg = tdist.group.WORLD
        if tdist.get_backend(pg) != "gloo":
            pg = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(pg, tdist.get_rank(), tdist.get_world_size(), timeout_s, "world")

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _translate_errors(self, op_name: str, seq: int, record=None):
        try:
            yield
        except (ValueError, TypeError):
            raise
        except RuntimeError as e:
            msg = str(e)
            where = f"{op_name} (seq {seq}) on group '{self.group_name}' (rank {self.rank} of {self.world_size})"
            timed_out = "timed out" in msg.lower() or "timeout" in msg.lower()
            if record is not None:
                record["state"] = "timed_out" if timed_out else "failed"
            path = self.recorder.dump(self.group_name, self.rank, self.world_size, self.seq, f"{where}: {msg}")
            if timed_out:
                raise CommTimeoutError(f"{where} timed out after {self.timeout_s:.1f}s "
                                       f"(flight record: {path}): {msg}") from e
            raise PyncclError(f"{where} failed (flight record: {path}): {msg}") from e

    def flight_record(self):
        return self.recorder.entries()

    def _check(self, fn: str, *tensors: torch.Tensor):
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"{fn}: expected a CPU tensor for the gloo backend, got a tensor on {t.device}")
            if t.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"{fn}: dtype {t.dtype} is not supported by the gloo backend "
                                f"(supported: {', '.join(str(d) for d in _SUPPORTED_DTYPES)})")
            if not t.is_contiguous():
                raise ValueError(f"{fn}: expected a contiguous tensor, got one with strides {t.stride()}; "
                                 f"call .contiguous() first")

    def _check_rank(self, fn: str, what: str, r: int):
        if not 0 <= r < self.world_size:
            raise ValueError(f"{fn}: {what}={r} out of range [0, world_size={self.world_size})")

    def _run(self, op_name: str, async_op: bool, start, finish=None, tensor=None, peer: int = -1):
        """Run `start()` (returns torch works), then `finish()` once they complete."""
        if self._destroyed:
            raise RuntimeError(f"{op_name}: group '{self.group_name}' was destroyed")
        self.seq += 1
        seq = self.seq
        record = self.recorder.record(op_name, seq, str(tensor.dtype) if tensor is not None else None,
                                      tensor.numel() if tensor is not None else 0, peer)
        with self._translate_errors(op_name, seq, record):
            works = start()
        if not isinstance(works, (list, tuple)):
            works = [works]
        work = GlooWork(self, op_name, seq, works, finish, record)
        if async_op:
            return work
        work.wait()
        return None

    def _prepare_reduce(self, fn: str, tensor: torch.Tensor, op):
        """(torch op, pre-scale or None, post-divisor or None) for `op` on `tensor`."""
        op = as_reduce_op(op, fn)
        op_enum = check_op_for_dtype(fn, op, tensor.dtype)
        pre = op.factor if isinstance(op, PremulSum) else None
        if op_enum == ReduceOp.PREMUL_SUM and pre is None:
            raise ValueError(f"{fn}: use ReduceOp.premul_sum(factor) to give PREMUL_SUM its factor")
        post = self.world_size if op_enum == ReduceOp.AVG else None
        return _NATIVE_OPS[op_enum], pre, post

    # ------------------------------------------------------------------ collectives
    def _check_output(self, fn: str, tensor: torch.Tensor, output) -> torch.Tensor:
        """`output=` of the out-of-place ops: a tensor like `tensor` (base.Backend.all_reduce)."""
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{fn}: output must be a torch.Tensor or None, got {type(output).__name__}")
        self._check(fn, output)
        if output.dtype != tensor.dtype:
            raise TypeError(f"{fn}: output has dtype {output.dtype}, expected {tensor.dtype} (the dtype of tensor)")
        if output.numel() != tensor.numel():
            raise ValueError(f"{fn}: output has {output.numel()} elements, expected {tensor.numel()} "
                             f"(the size of tensor)")
        return output

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False, output=None):
        self._check("all_reduce", tensor)
        top, pre, post = self._prepare_reduce("all_reduce", tensor, op)
        if output is not None:
            # NOTE: gloo has no out-of-place call: copy, then reduce the copy in place.
            self._check_output("all_reduce", tensor, output).view(tensor.shape).copy_(tensor)
            tensor = output
        if pre is not None:
            tensor.mul_(pre)
        finish = (lambda: tensor.div_(post)) if post else None
        return self._run("all_reduce", async_op,
                         lambda: tdist.all_reduce(tensor, op=top, group=self.pg, async_op=True), finish, tensor)

    def broadcast(self, tensor, root, async_op=False, output=None):
        self._check("broadcast", tensor)
        self._check_rank("broadcast", "src", root)
        if output is not None:
            self._check_output("broadcast", tensor, output)
            if self.rank == root:
                output.view(tensor.shape).copy_(tensor)
            tensor = output
        return self._run("broadcast", async_op,
                         lambda: tdist.broadcast(tensor, group=self.pg, group_src=root, async_op=True),
                         tensor=tensor, peer=root)

    def reduce(self, tensor, root, op=ReduceOp.SUM, async_op=False, output=None):
        self._check("reduce", tensor)
        self._check_rank("reduce", "dst", root)
        top, pre, post = self._prepare_reduce("reduce", tensor, op)
        if output is not None:
            self._check_output("reduce", tensor, output)
            # Only the root's output is written (as NCCL's); the others reduce from a scratch copy.
            if self.rank == root:
                output.view(tensor.shape).copy_(tensor)
            tensor = output if self.rank == root else tensor.clone()
        if pre is not None:
            tensor.mul_(pre)
        finish = (lambda: tensor.div_(post)) if post and self.rank == root else None
        return self._run("reduce", async_op,
                         lambda: tdist.reduce(tensor, group=self.pg, group_dst=root, op=top, async_op=True),
                         finish, tensor, root)

    def all_gather(self, output_list, input, async_op=False):
        self._check("all_gather", input, *output_list)
        return self._run("all_gather", async_op,
                         lambda: tdist.all_gather(output_list, input, group=self.pg, async_op=True), tensor=input)

    def all_gather_into_tensor(self, output, input, async_op=False):
        self._check("all_gather_into_tensor", output, input)
        chunks = list(output.view(-1).chunk(self.world_size))
        return self._run("all_gather_into_tensor", async_op,
                         lambda: tdist.all_gather(chunks, input.reshape(-1), group=self.pg, async_op=True),
                         tensor=input)

    def _reduce_scatter_flat(self, fn, output, flat_input, op, async_op):
        # gloo has no reduce_scatter: all-reduce a copy, keep this rank's chunk.
        top, pre, post = self._prepare_reduce(fn, output, op)
        work_buf = flat_input.clone()
        if pre is not None:
            work_buf.mul_(pre)

        def finish():
            mine = work_buf.view(-1).chunk(self.world_size)[self.rank]
            output.view(-1).copy_(mine)
            if post:
                output.div_(post)

        return self._run(fn, async_op,
                         lambda: tdist.all_reduce(work_buf, op=top, group=self.pg, async_op=True), finish, output)

    def reduce_scatter(self, output, input_list, op=ReduceOp.SUM, async_op=False):
        self._check("reduce_scatter", output, *input_list)
        flat = torch.cat([t.reshape(-1) for t in input_list])
        return self._reduce_scatter_flat("reduce_scatter", output, flat, op, async_op)

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op=False):
        self._check("reduce_scatter_tensor", output, input)
        return self._reduce_scatter_flat("reduce_scatter_tensor", output, input.reshape(-1), op, async_op)

    def _exchange(self, fn, output, input, output_rows, input_rows, async_op, finish=None, tensor=None):
        """gloo's all-to-all (alltoall_base, rows of dim 0 split as given), one torch work.
        NOTE: not point-to-point sends: a gloo send work dropped unwaited cancels its send, so an async
        all_to_all whose Work the caller let go (torch's own completes regardless) left its peers
        waiting, and the next collective hung; p2p works have no get_future() either."""
        return self._run(fn, async_op, lambda: tdist.all_to_all_single(
            output, input, output_rows, input_rows, group=self.pg, async_op=True), finish,
            tensor=input if tensor is None else tensor)

    def all_to_all(self, output_list, input_list, async_op=False):
        self._check("all_to_all", *output_list, *input_list)
        # torch's gloo all_to_all takes equal sizes only (2.11's none): the tensors go packed, back to back
        send = torch.cat([t.reshape(-1) for t in input_list])
        sizes = [t.numel() for t in output_list]
        recv = send.new_empty(sum(sizes))

        def finish():
            for t, piece in zip(output_list, recv.split(sizes)):
                t.view(-1).copy_(piece)
        return self._exchange("all_to_all", recv, send, sizes, [t.numel() for t in input_list], async_op, finish,
                              input_list[self.rank])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, async_op=False):
        self._check("all_to_all_single", output, input)
        return self._exchange("all_to_all_single", output, input, output_split_sizes or None,
                              input_split_sizes or None, async_op)

    def gather(self, input, gather_list, root, async_op=False):
        self._check("gather", input, *(gather_list or []))
        self._check_rank("gather", "dst", root)
        return self._run("gather", async_op,
                         lambda: tdist.gather(input, gather_list if self.rank == root else None,
                                              group=self.pg, group_dst=root, async_op=True),
                         tensor=input, peer=root)

    def scatter(self, output, scatter_list, root, async_op=False):
        self._check("scatter", output, *(scatter_list or []))
        self._check_rank("scatter", "src", root)
        return self._run("scatter", async_op,
                         lambda: tdist.scatter(output, scatter_list if self.rank == root else None,
                                               group=self.pg, group_src=root, async_op=True),
                         tensor=output, peer=root)

    def send(self, tensor, peer, async_op=False, tag=0):
        """`tag`: gloo's, as torch's: the peer's receive of the same tag takes it."""
        self._check("send", tensor)
        self._check_rank("send", "dst", peer)
        if peer == self.rank:
            raise ValueError(f"send: dst={peer} is this rank; gloo cannot send to itself")
        return self._run("send", async_op, lambda: tdist.isend(tensor, group=self.pg, tag=tag, group_dst=peer),
                         tensor=tensor, peer=peer)

    def recv(self, tensor, peer, async_op=False, tag=0):
        """`tag`: gloo's, as torch's: takes the peer's send of the same tag."""
        self._check("recv", tensor)
        self._check_rank("recv", "src", peer)
        if peer == self.rank:
            raise ValueError(f"recv: src={peer} is this rank; gloo cannot receive from itself")
        return self._run("recv", async_op, lambda: tdist.irecv(tensor, group=self.pg, tag=tag, group_src=peer),
                         tensor=tensor, peer=peer)

    def send_tagged(self, tensor, peer, async_op, tag):
        return self.send(tensor, peer, async_op, tag)

    def recv_tagged(self, tensor, peer, async_op, tag):
        return self.recv(tensor, peer, async_op, tag)

    def recv_any_source(self, tensor, tag=0) -> int:
        """Blocking receive from whichever rank sends first (with tag `tag`); returns its group rank
        (torch's recv(src=None), which gloo has)."""
        self._check("recv", tensor)
        sender = []

        def start():
            sender.append(tdist.recv(tensor, group=self.pg, tag=tag))   # blocks; returns a global rank
            return []
        self._run("recv", False, start, tensor=tensor)
        return tdist.get_group_rank(self.pg, sender[0]) if self.pg is not tdist.group.WORLD else sender[0]

    def batch_isend_irecv(self, ops, tags=None):
        """`tags`: tags[i] is ops[i]'s gloo tag (None: all 0), matched as torch's gloo matches them."""
        for is_send, t, peer in ops:
            self._check("batch_isend_irecv", t)
            self._check_rank("batch_isend_irecv", "peer", peer)
            if peer == self.rank:
                raise ValueError(f"batch_isend_irecv: peer {peer} is this rank; gloo cannot send to itself")

        def start():
            return tdist.batch_isend_irecv([
                tdist.P2POp(tdist.isend if is_send else tdist.irecv, t, group=self.pg, tag=tag, group_peer=peer)
                for (is_send, t, peer), tag in zip(ops, tags or [0] * len(ops))])
        return self._run("batch_isend_irecv", True, start)

    def batch_isend_irecv_tagged(self, ops, tags):
        return self.batch_isend_irecv(ops, tags)

    def batch_isend_irecv_works(self, ops, tags=None):
        """One GlooWork per op, as torch's batch_isend_irecv on gloo (no coalescing there): each
        completes with its own op. `tags`: as batch_isend_irecv's."""
        batch = self.batch_isend_irecv(ops, tags)   # its torch works: one per op
        self._unwaited = [w for w in self._unwaited if not w.is_completed()] + list(batch._works)

        def finish():   # the flight record's entry completes with the batch's last op
            if batch._record is not None and all(w.is_completed() for w in batch._works):
                batch._record["state"] = "completed"
        return [GlooWork(self, "batch_isend_irecv", batch._seq, [w], finish) for w in batch._works]

    def barrier(self):
        self._run("barrier", False, lambda: tdist.barrier(group=self.pg, async_op=True))

    def barrier_work(self) -> GlooWork:
        """barrier(async_op=True): gloo's own barrier (one rank may call barrier() meanwhile: the
        same gloo op), not started-and-waited: the GlooWork's wait() is the host wait."""
        return self._run("barrier", True, lambda: tdist.barrier(group=self.pg, async_op=True))

    # ------------------------------------------------------------------ bucket kernels
    def pack(self, tensors: List[torch.Tensor], flat: torch.Tensor, scale: float = 1.0):
        offset = 0
        for t in tensors:
            n = t.numel()
            dst, src = flat[offset: offset + n], t.reshape(-1)
            if scale == 1.0:
                dst.copy_(src)
            elif t.dtype == flat.dtype:
                torch.mul(src, scale, out=dst)
            else:
                dst.copy_(src * scale)  # scale, then cast: one rounding into flat's dtype
            offset += n

    def unpack(self, flat: torch.Tensor, tensors: List[torch.Tensor], scale: float = 1.0):
        offset = 0
        for t in tensors:
            n = t.numel()
            src = flat[offset: offset + n].view(t.shape)
            t.copy_(src * scale if scale != 1.0 else src)
            offset += n

    # ------------------------------------------------------------------ life cycle
    def split(self, ranks, timeout_s, name=""):
        global_ranks = [tdist.get_global_rank(self.pg, r) if self.pg is not tdist.group.WORLD else r for r in ranks]
        pg = tdist.new_group(global_ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        if self.rank not in ranks:
            return None
        _connected(pg)
        return GlooBackend(pg, ranks.index(self.rank), len(ranks), timeout_s, name or f"split{len(ranks)}")

    def duplicate(self, timeout_s, name: str) -> "GlooBackend":
        """A torch gloo group over the same ranks, made by them alone (members_only_groups.py)."""
        global_ranks = [tdist.get_global_rank(self.pg, r) if self.pg is not tdist.group.WORLD else r
                        for r in range(self.world_size)]
        pg = new_members_only_group(global_ranks, "gloo", timeout_s, f"dup/{self.pg.group_name}/{name}")
        _connected(pg)
        return GlooBackend(pg, self.rank, self.world_size, timeout_s, name)

    def destroy(self):
        self._destroyed = True
        self._unwaited = []
        if self.owns_pg and self.pg is not tdist.group.WORLD and tdist.is_initialized():
            try:
                tdist.destroy_process_group(self.pg)
            except (ValueError, RuntimeError):
                pass
        # NOTE: a future callback of one of this group's ops (GlooWork.get_future, coalesced ops)
        # may hold this backend until gloo's worker thread drops it. Were this the torch group's
        # last reference, its destructor would run on that worker thread and join it: std::terminate
        # ("Resource deadlock avoided"). The caller's thread lets go of it here instead.
        self.pg = None

    def abort(self):
        self.destroy()
