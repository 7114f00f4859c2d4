"""Issue 19's levers: settings of pynccl DDP that might hide its communication better, each
timed as one more mode against the floor, torch DDP and default pynccl DDP in the same run.

NCCL settings go to a communicator made for that mode only (pynccl.new_group() while the
PYNCCL_NCCL_* variables are set: csrc/communicator.cpp's make_config reads them at every init
and split), because NCCL reads its own NCCL_* variables once per process. Fewer channels is
maxCTAs (one CTA per channel); NCCL_MAX_NCHANNELS itself cannot change inside a process.
"""
import dataclasses
import os
from typing import Dict, Optional, Tuple

import pynccl
from pynccl.comm.coalesced import MiB


@dataclasses.dataclass(frozen=True)
class Lever:
    name: str
    why: str
    nccl_env: Dict[str, str] = dataclasses.field(default_factory=dict)   # for this mode's communicator
    min_nccl: Tuple[int, int, int] = (2, 18, 0)                         # runtime NCCL it needs
    ddp_kwargs: Dict[str, object] = dataclasses.field(default_factory=dict)
    first_bucket_mb: Optional[float] = None     # the first bucket's cap after the rebuild (default 1 MiB)
    register_buffers: bool = False              # ncclCommRegister of every bucket (NCCL >= 2.19)
    comm_prio0: bool = False                    # the communicator's stream at normal priority
    hook: Optional[str] = None                  # a built-in comm hook of pynccl.comm_hooks, by name
    overlap_optimizer: bool = False             # DDP.overlap_optimizer: the step per bucket, in backward
    unpack_early: Optional[bool] = None         # reducer.unpack_early (None: the default)
    tail_chunks: int = 1                        # reducer.tail_chunks: the last bucket pipelined in slices
    rows_in_window: Optional[bool] = None       # reducer.tied_rows.rows_in_window (None: the default)
    copy_pack: Optional[bool] = None            # reducer.copy_pack (None: the default)
    rows_chunks: Optional[int] = None           # reducer.tied_rows.rows_chunks (None: the default)


LEVERS = {lv.name: lv for lv in [
    Lever("cta-efficiency", "ncclConfig_t.CTAPolicy = NCCL_CTA_POLICY_EFFICIENCY: fewer SMs for the same bandwidth",
          {"PYNCCL_NCCL_CTA_POLICY": "1"}, (2, 27, 0)),
    # NOTE: not in the default set: copy engines move bytes but cannot add, so NCCL 2.28's
    # copy-engine collectives (symmetric-window all-gather / all-to-all) do not cover all-reduce.
    Lever("cta-zero", "CTAPolicy = NCCL_CTA_POLICY_ZERO: copy-engine collectives where NCCL supports them "
          "(else NCCL's kernels)", {"PYNCCL_NCCL_CTA_POLICY": "2"}, (2, 28, 0)),
    Lever("max-ctas-8", "maxCTAs 8: at most 8 channels, fewer SMs taken from backward",
          {"PYNCCL_NCCL_MIN_CTAS": "1", "PYNCCL_NCCL_MAX_CTAS": "8"}),
    Lever("max-ctas-4", "maxCTAs 4", {"PYNCCL_NCCL_MIN_CTAS": "1", "PYNCCL_NCCL_MAX_CTAS": "4"}),
    Lever("max-ctas-2", "maxCTAs 2", {"PYNCCL_NCCL_MIN_CTAS": "1", "PYNCCL_NCCL_MAX_CTAS": "2"}),
    # NOTE: NCCL's symmetric kernels take the fewest CTAs its model puts within 2.5 % of the
    # fastest (sym_kernels.cc), for an idle GPU; minCTAs raises that floor (session 15: a 28 MB
    # bucket's symmetric reduce-scatter ran 1.2 ms beside backward on 4xH100).
    Lever("min-ctas-16", "minCTAs 16 (maxCTAs 32): NCCL's symmetric kernels on at least 16 CTAs",
          {"PYNCCL_NCCL_MIN_CTAS": "16", "PYNCCL_NCCL_MAX_CTAS": "32"}),
    Lever("cga-1", "cgaClusterSize 1: no CTA clusters (Hopper's default is 4)", {"PYNCCL_NCCL_CGA_CLUSTER_SIZE": "1"}),
    Lever("register", "bucket buffers registered with ncclCommRegister (zero-copy where NCCL can)",
          min_nccl=(2, 19, 0), register_buffers=True),
    Lever("bucket-10mb", "bucket_cap_mb 10 (default 25): reductions start earlier, more of them",
          ddp_kwargs=dict(bucket_cap_mb=10)),
    Lever("bucket-50mb", "bucket_cap_mb 50: fewer, larger reductions", ddp_kwargs=dict(bucket_cap_mb=50)),
    Lever("first-bucket-25mb", "first bucket as large as the others (default 1 MiB)", first_bucket_mb=25),
    Lever("grad-view", "gradient_as_bucket_view=True: no copy into or out of the buckets",
          ddp_kwargs=dict(gradient_as_bucket_view=True)),
    Lever("comm-prio0", "the communicator's stream at normal priority (default: high)", comm_prio0=True),
    # Issue 26: where the buckets live and which NCCL kernels reduce them (pynccl/ddp/comm_path.py).
    Lever("comm-default", "comm_path='default': ordinary buffers, NCCL's default all-reduce kernels",
          ddp_kwargs=dict(comm_path="default")),
    Lever("comm-symmetric", "comm_path='symmetric': buckets in an NCCL symmetric window, symmetric all-reduce kernels",
          min_nccl=(2, 27, 0), ddp_kwargs=dict(comm_path="symmetric")),
    Lever("comm-copy-engine", "comm_path='copy_engine': symmetric reduce-scatter + copy-engine all-gather",
          min_nccl=(2, 28, 0), ddp_kwargs=dict(comm_path="copy_engine")),
    Lever("comm-copy-engine-a2a", "comm_path='copy_engine_a2a': the reduce-scatter as a copy-engine all-to-all "
          "+ one local sum, then the copy-engine all-gather", min_nccl=(2, 28, 0),
          ddp_kwargs=dict(comm_path="copy_engine_a2a")),
    Lever("overlap-optimizer", "DDP.overlap_optimizer: each bucket's AdamW step in backward, once its all-reduce "
          "ends (exact; opt-in)", overlap_optimizer=True),
    Lever("bf16-wire", "bf16_compress_hook: a bf16 wire (half the bytes), fp32 accumulation in the symmetric kernels",
          hook="bf16_compress_hook"),
    # Issue 26: where the write-back (unpack) of the default gradient_as_bucket_view=False runs.
    Lever("unpack-early", "reducer.unpack_early: each bucket unpacked into .grad on a side stream as soon as its "
          "all-reduce ends (exact); backward's end only joins streams", unpack_early=True),
    Lever("unpack-late", "reducer.unpack_early=False: every bucket unpacked on the compute stream at the end of "
          "backward", unpack_early=False),
    # Issue 26, item 3: the tied embedding's tail (pynccl/ddp/embedding_rows.py).
    Lever("tied-rows", "tied_embedding_rows=True: the tied weight's head part all-reduced as soon as it is in, the "
          "rest exchanged as the rows that carry it at the end (the default since session 13)",
          ddp_kwargs=dict(tied_embedding_rows=True)),
    # Levers that each measured below the default, together (never timed together before session 11).
    Lever("copy-engine+grad-view", "comm_path='copy_engine' and gradient_as_bucket_view=True", min_nccl=(2, 28, 0),
          ddp_kwargs=dict(comm_path="copy_engine", gradient_as_bucket_view=True)),
    Lever("copy-engine+grad-view+tied-rows", "the two above and tied_embedding_rows=True", min_nccl=(2, 28, 0),
          ddp_kwargs=dict(comm_path="copy_engine", gradient_as_bucket_view=True, tied_embedding_rows=True)),
    Lever("grad-view+tied-rows", "gradient_as_bucket_view=True and tied_embedding_rows=True (symmetric buckets)",
          min_nccl=(2, 27, 0), ddp_kwargs=dict(gradient_as_bucket_view=True, tied_embedding_rows=True)),
    Lever("copy-engine+grad-view+overlap-optimizer", "comm_path='copy_engine', gradient_as_bucket_view=True and "
          "overlap_optimizer (opt-in)", min_nccl=(2, 28, 0),
          ddp_kwargs=dict(comm_path="copy_engine", gradient_as_bucket_view=True), overlap_optimizer=True),
    # NOTE: comm_path named: "auto" is the copy engine since session 13 (in session 13's last runs
    # these two levers still left it to "auto").
    Lever("copies+plain-tied", "the defaults before session 12: gradient_as_bucket_view=False, "
          "tied_embedding_rows=False, comm_path='symmetric'",
          ddp_kwargs=dict(gradient_as_bucket_view=False, tied_embedding_rows=False, comm_path="symmetric")),
    Lever("views+plain-tied", "the defaults of session 12: gradient_as_bucket_view=True, tied_embedding_rows=False, "
          "comm_path='symmetric'",
          ddp_kwargs=dict(gradient_as_bucket_view=True, tied_embedding_rows=False, comm_path="symmetric")),
    Lever("views+plain-tied+copy-engine", "session 13's defaults without the tied tail: gradient_as_bucket_view=True, "
          "tied_embedding_rows=False, comm_path='copy_engine'",
          ddp_kwargs=dict(gradient_as_bucket_view=True, tied_embedding_rows=False, comm_path="copy_engine")),
    Lever("rows-plain-buffers", "the tied tail's rows all-gathered through ordinary buffers (ring kernels), not "
          "the symmetric window of session 14 (copy engines)", rows_in_window=False),
    Lever("copy-pack", "reducer.copy_pack: on the split paths the pack copies on the copy engines, unscaled, and "
          "each rank scales its reduced shard (no pack kernel on the SMs beside backward)", copy_pack=True),
    Lever("rows-unchunked", "the tied tail's rows gathered in one piece, their index_add_s after it (before session "
          "16: rows_chunks=1), not in slices whose adds overlap the next slice's gather", rows_chunks=1),
    Lever("unpack-early-tail4", "unpack-early, and the last bucket's pack / all-reduce / unpack pipelined over 4 "
          "slices (its unpack overlaps its all-reduce)", unpack_early=True, tail_chunks=4),
]}
DEFAULT_LEVERS = ["comm-default", "comm-symmetric", "comm-copy-engine", "cta-efficiency", "max-ctas-8", "max-ctas-4",
                  "register", "bucket-10mb", "bucket-50mb", "first-bucket-25mb", "grad-view", "comm-prio0"]
MODE_PREFIX = "pynccl DDP + "


def parse(names):
    """--levers argument -> list of Lever ('default', 'all' or names)."""
    if not names or names == ["default"]:
        names = DEFAULT_LEVERS
    elif names == ["all"]:
        names = list(LEVERS)
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise SystemExit(f"ddp_bench: unknown lever(s) {unknown}; known: {sorted(LEVERS)}")
    return [LEVERS[n] for n in names]


def unavailable(lever: Lever) -> Optional[str]:
    """Why `lever` cannot run in this process (the runtime NCCL is too old), or None."""
    if lever.min_nccl > (2, 18, 0) or lever.nccl_env or lever.register_buffers or lever.comm_prio0 or \
            "comm_path" in lever.ddp_kwargs or lever.unpack_early is not None or lever.tail_chunks != 1 or \
            lever.rows_in_window is not None or lever.copy_pack is not None:
        if not pynccl.is_initialized() or pynccl.get_backend() != "nccl":
            return "needs the nccl backend"
        version = pynccl.nccl_version()          # the headers pynccl was built with and the library loaded
        for what, v in (("runs", tuple(version.runtime)), ("was built with", tuple(version.build))):
            if v < lever.min_nccl:
                return f"needs NCCL >= {'.'.join(map(str, lever.min_nccl))}, pynccl {what} {'.'.join(map(str, v))}"
    return None


def make_group(lever: Lever):
    """A pynccl group over every rank for this lever's DDP (collective), or None for the default
    group when the lever changes nothing in NCCL."""
    env = dict(lever.nccl_env)
    if lever.comm_prio0:
        env["PYNCCL_COMM_STREAM_HIGH_PRIORITY"] = "0"
    return group_with_env(env) if env else None


def group_with_env(env: Dict[str, str]):
    """pynccl.new_group() over every rank (collective), made while the PYNCCL_* variables `env`
    are set (comm_config.cpp reads them at every init and split), then restored."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return pynccl.new_group()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def apply(ddp, lever: Lever) -> None:
    """What is set on a built pynccl DDP (before its first step)."""
    if lever.first_bucket_mb is not None:
        # NOTE: the first buckets are built at construction; the rebuild after the first step uses this.
        ddp.reducer.bucketer.first_bucket_cap_bytes = int(lever.first_bucket_mb * MiB)
    if lever.register_buffers:
        ddp.reducer.register_buffers = True
    if lever.unpack_early is not None:
        ddp.reducer.unpack_early = lever.unpack_early
    ddp.reducer.tail_chunks = lever.tail_chunks
    if lever.copy_pack is not None:
        ddp.reducer.copy_pack = lever.copy_pack
    if lever.rows_in_window is not None and ddp.reducer.tied_rows is not None:
        ddp.reducer.tied_rows.rows_in_window = lever.rows_in_window
    if lever.rows_chunks is not None and ddp.reducer.tied_rows is not None:
        ddp.reducer.tied_rows.rows_chunks = lever.rows_chunks
    if lever.hook is not None:
        ddp.register_comm_hook(None, getattr(pynccl.comm_hooks, lever.hook))
