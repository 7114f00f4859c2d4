// How TP's collective matmuls (tp_overlap.cpp) move their chunks between ranks: the rank-major
// all-gather and the whole tensor's natural layout, the symmetric window's slots, the partial sums
// gathered for a local sum, and the peers' parts of a reduce-scatter. Internal to _C (no bindings).
//
// A rank's chunk of dim seq_dim is [r*s, (r+1)*s). GEMMs run on the caller's stream, the
// collectives on the communicator's (Work::wait joins them).
#pragma once

#include <ATen/ATen.h>

#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "communicator.h"
#include "work.h"

namespace pynccl::tp_exchange {

// Chunk j of n along seq_dim (a view).
at::Tensor seq_chunk(const at::Tensor& t, int64_t seq_dim, int64_t n, int64_t j);
// shape with dim seq_dim n times as long (and the last dim `last` where given).
std::vector<int64_t> with_seq_times(c10::IntArrayRef shape, int64_t seq_dim, int64_t n, int64_t last = -1);
cudaStream_t caller_stream(const Communicator& comm);
// The communicator's own stream, where its async collectives run (nullptr where it has none).
cudaStream_t comm_stream_of(const Communicator& comm);

// The whole tensor in its natural layout from an all-gather's rank-major chunks, copied on the comm
// stream right behind the all-gather that writes them: one strided 2-D copy per chunk
// (cudaMemcpy2DAsync: `outer` rows of one chunk's bytes into rows n times as long; the driver runs it
// as its own copy kernel, memcpyDtoD2D_*), off the caller's stream, so the caller's GEMMs on the
// peers' chunks run beside it. torch's copy kernels on the caller's stream cost a compiled TP+SP
// step of Llama 1.1B at batch 4 2 ms of its 77 (2xH200, session 21). Where the layouts agree the
// gathered chunks are the whole tensor (a view, unless own_copy), and where a row is past a 2-D
// copy's pitch torch's copies run instead, after the caller's wait. Use:
//   NaturalLayout whole(comm, local, seq_dim, n);   // before the all-gather is queued
//   (queue the all-gather into `gathered`); whole.queue(gathered);
//   (the caller waits for the gather, runs its GEMMs); at::Tensor t = whole.take(gathered);
class NaturalLayout {
 public:
  // NOTE: the result is allocated here, before the all-gather orders the comm stream after the
  // caller's: a block the caller's stream freed later could otherwise become it while a caller
  // kernel still uses it, and the comm stream's copy would write over that kernel's data.
  // own_copy: copy even where the layouts agree (the gathered chunks lie in a window the next op reuses).
  NaturalLayout(Communicator& comm, const at::Tensor& local, int64_t seq_dim, int64_t n, bool own_copy = false);
  NaturalLayout(const NaturalLayout&) = delete;
  NaturalLayout& operator=(const NaturalLayout&) = delete;
  // NOTE: an exception between queue() and take() (a failed wait, an aborted communicator) still
  // orders the caller's stream after the copies before their buffers go back to the allocator.
  ~NaturalLayout();

  // Right after the all-gather into `gathered` was queued (before the caller waits for it).
  void queue(const at::Tensor& gathered);
  // After the caller waited for the gather: the whole tensor, the caller's stream now after the copies.
  at::Tensor take(const at::Tensor& gathered);

 private:
  void join();

  Communicator& comm_;
  const at::Tensor local_;
  const int64_t seq_dim_, n_;
  int64_t outer_ = 1;
  size_t row_ = 0;
  std::optional<at::Tensor> whole_;
  bool queued_ = false;
};

// Where a sum to be all-reduced is computed: a view of the symmetric window `scratch` (NCCL's
// symmetric kernels, a few CTAs) or, without one, the output itself.
at::Tensor sum_buffer(const std::optional<at::Tensor>& scratch, const at::Tensor& out, const char* fn);

// The all-reduced sum in `buf` into `out` (a no-op where buf is out): copied on the comm stream after
// the all-reduces queued there, then the caller's stream waits for the copy.
void finish_sums(Communicator& comm, const std::vector<std::shared_ptr<Work>>& works, const at::Tensor& buf,
                 at::Tensor& out);

// The gather path's sums: every rank's partial of an (rows, cols) result gathered into the
// symmetric window `scratch` (an all-gather there runs on the copy engines under CTAPolicy ZERO:
// no SM is taken from the GEMMs beside it), then summed on the caller's stream in rank order, so
// every rank computes the same sum. Rows [lo, lo + m) of all ranks form one block of n * m rows
// at row n * lo: rank j's partial of them is the block's j-th (m, cols) piece.
// NOTE: the window may be reused by the next op as soon as the sums are queued: its own rows are
// written in the caller's stream order after them, and a peer's gather writes into this rank's
// window only once this rank's comm stream, which waits for the caller's, has joined that gather
// (NCCL's copy-engine collectives synchronize the ranks before they copy).
class Partials {
 public:
  Partials(Communicator& comm, const std::optional<at::Tensor>& scratch, const at::Tensor& like, const char* fn);
  // This rank's partial of rows [lo, lo + m).
  at::Tensor own_rows(int64_t lo, int64_t m) const { return win_.narrow(0, n_ * lo + r_ * m, m); }
  at::Tensor own() const { return own_rows(0, rows_).view(shape_); }  // shaped as the result
  // Every rank's partial of rows [lo, lo + m), queued on the comm stream.
  std::shared_ptr<Work> gather_rows(int64_t lo, int64_t m);
  std::shared_ptr<Work> gather() { return gather_rows(0, rows_); }
  // out = the sum over ranks of rows [lo, lo + m), in rank order (after the gather's wait).
  void sum_rows_into(const at::Tensor& out, int64_t lo, int64_t m) const;
  void sum_into(const at::Tensor& out) const { sum_rows_into(out, 0, rows_); }

 private:
  Communicator& comm_;
  const int64_t n_, r_, cols_;
  const std::vector<int64_t> shape_;
  int64_t rows_ = 0;
  at::Tensor win_;
};

// The sequence-parallel ops' exchanges through a symmetric window (scratch given): `slots` pieces
// shaped as `like`, one after another from the window's start. In a window an all-gather and an
// all-to-all run on the copy engines (CTAPolicy ZERO): the GEMMs beside them keep every SM, where
// NCCL's kernels on ordinary memory take some (async_tp.py says when the window is used).
// NOTE: the window may be reused by the next op once this op's last read of it is queued on the
// caller's stream (or the comm stream, which the caller's then waits for): the next op writes its
// own slots in stream order after that, and a peer writes into this rank's window only once this
// rank's comm stream, which waits for the caller's, has joined the collective (NCCL's copy-engine
// collectives synchronize the ranks before they copy), as for Partials above.
at::Tensor window_slots(const at::Tensor& scratch, int64_t slots, const at::Tensor& like, const char* fn);

// (gathered, its Work): this rank's chunk all-gathered rank-major ((n * rows, ...), chunk j at rows
// [j * rows, ...)), into `scratch`'s slots where given, else into a new tensor. In the window the
// chunk is first copied into this rank's slot on the comm stream (NCCL 2.28 takes the send buffer
// from the window too), so the caller's GEMMs on its own chunk run beside that copy as well.
// NOTE: `local` is read on the comm stream: the caller's wait for the returned Work orders its
// stream after that read before `local` can go back to the allocator.
std::pair<at::Tensor, std::shared_ptr<Work>> start_gather(Communicator& comm, const at::Tensor& local,
                                                          const std::optional<at::Tensor>& scratch, const char* fn);

// Every peer's part of this rank's chunk of a sum (the reduce-scatter of the sequence-parallel ops).
// partial(j, out) writes this rank's part of rank j's chunk into out (shaped `like`); the peers' parts
// are made first and travel while the caller computes its own chunk (and its weight GEMMs), then
// add_into(own) adds what arrived in the ring's order ((r - 1) % n, (r - 2) % n, ...), as the Python
// reference does. Without scratch, one send/recv pair per peer (NCCL's kernels; each send's Work keeps
// its part alive); with it, the parts are computed into the window's first n slots (slot j for rank
// j) and one all-to-all puts them in the next n.
class PeerParts {
 public:
  PeerParts(Communicator& comm, const at::Tensor& like, const std::optional<at::Tensor>& scratch, const char* fn,
            const std::function<void(int64_t, at::Tensor)>& partial);
  at::Tensor add_into(at::Tensor own);

 private:
  const int64_t n_, r_;
  std::vector<std::shared_ptr<Work>> works_;
  std::vector<at::Tensor> received_;
};

}  // namespace pynccl::tp_exchange
