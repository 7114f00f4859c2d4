// TP's collective matmuls on NCCL (pynccl/tensor_parallel/async_tp.py's and async_tp_allreduce.py's ops):
// the same decomposition as the Python reference there, one C++ call per op. The Python one paid
// ~20 µs of host per launch on 2×H200's hosts, twice the launches of the plain path, and a
// compiled Llama 1.1B step became host-bound (RESULTS, tensor parallelism, session 19).
//
// A rank's chunk of dim seq_dim is [r*s, (r+1)*s). GEMMs run on the caller's stream, the
// collectives on the communicator's (Work::wait joins them); chunk views of [b, s, h] tensors are
// strided and go through bmm with the batch stride as it is (no copy).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "check.h"
#include "communicator.h"
#include "dtypes.h"
#include "tp_overlap.h"
#include "work.h"

namespace pynccl {
namespace {

at::Tensor seq_chunk(const at::Tensor& t, int64_t seq_dim, int64_t n, int64_t j) {
  const int64_t s = t.size(seq_dim) / n;
  return t.narrow(seq_dim, j * s, s);
}

// out (+)= a @ b; a (.., k), b (k, m), out (.., m).
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (a.is_contiguous() && out.is_contiguous()) {
    at::Tensor o2 = out.view({-1, out.size(-1)});
    const at::Tensor a2 = a.view({-1, a.size(-1)});
    if (accumulate) {
      o2.addmm_(a2, b);
    } else {
      at::mm_out(o2, a2, b);
    }
  } else if (a.dim() == 3 && out.dim() == 3) {
    const at::Tensor bb = b.expand({a.size(0), b.size(0), b.size(1)});  // batch stride 0
    if (accumulate) {
      out.baddbmm_(a, bb);
    } else {
      at::bmm_out(out, a, bb);
    }
  } else if (accumulate) {
    out.add_(at::matmul(a, b));
  } else {
    out.copy_(at::matmul(a, b));
  }
}

std::vector<int64_t> with_seq_times(c10::IntArrayRef shape, int64_t seq_dim, int64_t n, int64_t last = -1) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  out[seq_dim] *= n;
  if (last >= 0) out.back() = last;
  return out;
}

cudaStream_t caller_stream(const Communicator& comm) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(comm.device())).stream();
}

// The communicator's own stream, where its async collectives run (nullptr where it has none).
cudaStream_t comm_stream_of(const Communicator& comm) { return reinterpret_cast<cudaStream_t>(comm.stream_handle()); }

// The chunks of dim seq_dim stacked rank after rank are the tensor itself: every dim before it has size 1.
bool rank_major_is_natural(c10::IntArrayRef shape, int64_t seq_dim) {
  for (int64_t d = 0; d < seq_dim; ++d) {
    if (shape[d] != 1) return false;
  }
  return true;
}

// (n * rows, ...) rank-major buffer for an all-gather of `local` (rows = local's dim 0).
at::Tensor gather_buffer(const at::Tensor& local, int64_t n) {
  std::vector<int64_t> shape(local.sizes().begin(), local.sizes().end());
  shape[0] *= n;
  return at::empty(shape, local.options());
}

// The whole tensor in its natural layout from the rank-major gathered chunks (a view where the
// layouts agree, else torch's copy kernel per chunk on the caller's stream, after the gather).
at::Tensor natural(const at::Tensor& gathered, const at::Tensor& local, int64_t seq_dim, int64_t n) {
  const auto shape = with_seq_times(local.sizes(), seq_dim, n);
  if (rank_major_is_natural(local.sizes(), seq_dim)) return gathered.view(shape);
  at::Tensor whole = at::empty(shape, local.options());
  const auto pieces = gathered.chunk(n, 0);
  for (int64_t j = 0; j < n; ++j) seq_chunk(whole, seq_dim, n, j).copy_(pieces[j]);
  return whole;
}

// natural()'s copies queued on the comm stream instead, right behind the all-gather that writes
// the rank-major chunks: one strided 2-D copy per chunk (cudaMemcpy2DAsync: `outer` rows of one
// chunk's bytes into rows n times as long; the driver runs it as its own copy kernel,
// memcpyDtoD2D_*), off the caller's stream, so the caller's GEMMs on the peers' chunks run beside
// it. torch's copy kernels on the caller's stream cost a compiled TP+SP step of Llama 1.1B at
// batch 4 2 ms of its 77 (2xH200, session 21). Where natural() is a view, or a row is past a 2-D
// copy's pitch, natural() runs instead, after the caller's wait. Use:
//   NaturalLayout whole(comm, local, seq_dim, n);   // before the all-gather is queued
//   (queue the all-gather into `gathered`); whole.queue(gathered);
//   (the caller waits for the gather, runs its GEMMs); at::Tensor t = whole.take(gathered);
class NaturalLayout {
 public:
  // NOTE: the result is allocated here, before the all-gather orders the comm stream after the
  // caller's: a block the caller's stream freed later could otherwise become it while a caller
  // kernel still uses it, and the comm stream's copy would write over that kernel's data.
  // own_copy: copy even where the layouts agree (the gathered chunks lie in a window the next op reuses).
  NaturalLayout(Communicator& comm, const at::Tensor& local, int64_t seq_dim, int64_t n, bool own_copy = false)
      : comm_(comm), local_(local), seq_dim_(seq_dim), n_(n) {
    if ((!own_copy && rank_major_is_natural(local.sizes(), seq_dim)) || comm_stream_of(comm) == nullptr ||
        local.numel() == 0) {
      return;
    }
    for (int64_t d = 0; d < seq_dim; ++d) outer_ *= local.size(d);
    row_ = static_cast<size_t>(local.numel() / outer_) * local.element_size();  // one chunk's row
    constexpr size_t kMaxPitch = 2147483647;  // cudaDevAttrMaxPitch on every CUDA GPU so far
    if (static_cast<size_t>(n) * row_ > kMaxPitch) return;
    whole_ = at::empty(with_seq_times(local.sizes(), seq_dim, n), local.options());
  }
  NaturalLayout(const NaturalLayout&) = delete;
  NaturalLayout& operator=(const NaturalLayout&) = delete;

  // Right after the all-gather into `gathered` was queued (before the caller waits for it).
  void queue(const at::Tensor& gathered) {
    if (!whole_.has_value()) return;
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(comm_.device()));
    const cudaStream_t comm_stream = comm_stream_of(comm_);
    char* const dst = static_cast<char*>(whole_->data_ptr());
    const char* const src = static_cast<const char*>(gathered.data_ptr());
    if (outer_ == 1) {  // the layouts agree: one copy (on the copy engines, where the 2-D ones take a kernel)
      C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, n_ * row_, cudaMemcpyDeviceToDevice, comm_stream));
      queued_ = true;
      return;
    }
    for (int64_t j = 0; j < n_; ++j) {
      // cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
      //                               size_t height, cudaMemcpyKind kind, cudaStream_t stream);
      C10_CUDA_CHECK(cudaMemcpy2DAsync(dst + j * row_, n_ * row_, src + j * outer_ * row_, row_, row_,
                                       static_cast<size_t>(outer_), cudaMemcpyDeviceToDevice, comm_stream));
      queued_ = true;  // per copy: one that failed after others still leaves those to join
    }
  }

  // After the caller waited for the gather: the whole tensor, the caller's stream now after the copies.
  at::Tensor take(const at::Tensor& gathered) {
    if (!queued_) return natural(gathered, local_, seq_dim_, n_);
    join();
    return *whole_;
  }

  // NOTE: an exception between queue() and take() (a failed wait, an aborted communicator) still
  // orders the caller's stream after the copies before their buffers go back to the allocator.
  ~NaturalLayout() {
    try {
      join();
    } catch (...) {
    }
  }

 private:
  void join() {
    if (!queued_) return;
    queued_ = false;
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(comm_.device()));
    comm_.order_after(caller_stream(comm_), comm_stream_of(comm_));
  }

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
at::Tensor sum_buffer(const std::optional<at::Tensor>& scratch, const at::Tensor& out, const char* fn) {
  if (!scratch.has_value()) return out;
  const int64_t nbytes = out.numel() * static_cast<int64_t>(out.element_size());
  PYNCCL_CHECK_VALUE(scratch->scalar_type() == at::kByte && scratch->dim() == 1 && scratch->numel() >= nbytes, fn,
                     ": scratch must be a 1-D uint8 window of at least ", nbytes, " bytes, got ", scratch->dim(),
                     "-D with ", scratch->numel(), " elements of ", std::string(c10::toString(scratch->scalar_type())));
  return scratch->narrow(0, 0, nbytes).view(out.scalar_type()).view(out.sizes());
}

// The all-reduced sum in `buf` into `out` (a no-op where buf is out): copied on the comm stream after
// the all-reduces queued there, then the caller's stream waits for the copy.
void finish_sums(Communicator& comm, const std::vector<std::shared_ptr<Work>>& works, const at::Tensor& buf,
                 at::Tensor& out) {
  if (buf.data_ptr() == out.data_ptr()) {
    for (const auto& work : works) work->wait(std::nullopt);
    return;
  }
  const auto device = static_cast<c10::DeviceIndex>(comm.device());
  const cudaStream_t caller = caller_stream(comm);
  const cudaStream_t comm_stream = comm_stream_of(comm);
  {
    const c10::cuda::CUDAStreamGuard on_comm(c10::cuda::getStreamFromExternal(comm_stream, device));
    out.copy_(buf);  // NOTE: out is the caller's (allocated on its stream, which waits below before any use)
  }
  comm.order_after(caller, comm_stream);
}

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
  Partials(Communicator& comm, const std::optional<at::Tensor>& scratch, const at::Tensor& like, const char* fn)
      : comm_(comm), n_(comm.world_size()), r_(comm.rank()), cols_(like.dim() ? like.size(-1) : 1),
        shape_(like.sizes().vec()) {
    const int64_t nbytes = n_ * like.numel() * static_cast<int64_t>(like.element_size());
    PYNCCL_CHECK_VALUE(scratch.has_value() && scratch->scalar_type() == at::kByte && scratch->dim() == 1 &&
                           scratch->numel() >= nbytes,
                       fn, ": the gathered sums need a 1-D uint8 symmetric window of at least ", nbytes,
                       " bytes (world_size x the result's)");
    rows_ = cols_ ? like.numel() / cols_ : 0;
    win_ = scratch->narrow(0, 0, nbytes).view(like.scalar_type()).view({n_ * rows_, cols_});
  }
  // This rank's partial of rows [lo, lo + m).
  at::Tensor own_rows(int64_t lo, int64_t m) const { return win_.narrow(0, n_ * lo + r_ * m, m); }
  at::Tensor own() const { return own_rows(0, rows_).view(shape_); }  // shaped as the result
  // Every rank's partial of rows [lo, lo + m), queued on the comm stream.
  std::shared_ptr<Work> gather_rows(int64_t lo, int64_t m) {
    return comm_.all_gather_into_tensor(win_.narrow(0, n_ * lo, n_ * m), own_rows(lo, m), /*async_op=*/true);
  }
  std::shared_ptr<Work> gather() { return gather_rows(0, rows_); }
  // out = the sum over ranks of rows [lo, lo + m), in rank order (after the gather's wait).
  void sum_rows_into(const at::Tensor& out, int64_t lo, int64_t m) const {
    const at::Tensor block = win_.narrow(0, n_ * lo, n_ * m).view({n_, m, cols_});
    at::Tensor o = out.view({m, cols_});
    if (n_ == 2) {
      at::add_out(o, block[0], block[1]);
    } else {
      at::sum_out(o, block, {0});
    }
  }
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
at::Tensor window_slots(const at::Tensor& scratch, int64_t slots, const at::Tensor& like, const char* fn) {
  const int64_t nbytes = slots * like.numel() * static_cast<int64_t>(like.element_size());
  PYNCCL_CHECK_VALUE(scratch.scalar_type() == at::kByte && scratch.dim() == 1 && scratch.numel() >= nbytes, fn,
                     ": scratch must be a 1-D uint8 window of at least ", nbytes, " bytes (", slots,
                     " x the chunk's), got ", scratch.dim(), "-D with ", scratch.numel(), " elements of ",
                     std::string(c10::toString(scratch.scalar_type())));
  std::vector<int64_t> shape{slots};
  shape.insert(shape.end(), like.sizes().begin(), like.sizes().end());
  return scratch.narrow(0, 0, nbytes).view(like.scalar_type()).view(shape);
}

// (gathered, its Work): this rank's chunk all-gathered rank-major ((n * rows, ...), chunk j at rows
// [j * rows, ...)), into `scratch`'s slots where given (the chunk copied into this rank's slot first),
// else into a new tensor.
std::pair<at::Tensor, std::shared_ptr<Work>> start_gather(Communicator& comm, const at::Tensor& local,
                                                          const std::optional<at::Tensor>& scratch, const char* fn) {
  const int64_t n = comm.world_size();
  if (!scratch.has_value()) {
    at::Tensor gathered = gather_buffer(local, n);
    return {gathered, comm.all_gather_into_tensor(gathered, local, /*async_op=*/true)};
  }
  const at::Tensor slots = window_slots(*scratch, n, local, fn);
  const at::Tensor mine = slots.select(0, comm.rank());
  mine.copy_(local);
  return {slots.flatten(0, 1), comm.all_gather_into_tensor(slots, mine, /*async_op=*/true)};
}

using Exchange = std::tuple<std::shared_ptr<Work>, at::Tensor, at::Tensor>;  // (work, sent, received)

// Sends `part` to rank `to` and receives the same shape from `frm`, in one NCCL group.
Exchange exchange(Communicator& comm, const at::Tensor& part, int64_t to, int64_t frm) {
  at::Tensor recv = at::empty_like(part);
  auto work = comm.batch_isend_irecv({std::make_tuple(true, part, to), std::make_tuple(false, recv, frm)});
  return {work, part, recv};
}

// Every peer's part of this rank's chunk of a sum (the reduce-scatter of the ops below). partial(j, out)
// writes this rank's part of rank j's chunk into out (shaped `like`); the peers' parts are made first
// and travel while the caller computes its own chunk (and its weight GEMMs), then add_into(own) adds
// what arrived in the ring's order ((r - 1) % n, (r - 2) % n, ...), as the Python reference does.
// Without scratch, one send/recv pair per peer (NCCL's kernels); with it, the parts are computed into
// the window's first n slots (slot j for rank j) and one all-to-all puts them in the next n.
class PeerParts {
 public:
  template <typename Partial>
  PeerParts(Communicator& comm, const at::Tensor& like, const std::optional<at::Tensor>& scratch, const char* fn,
            Partial&& partial)
      : n_(comm.world_size()), r_(comm.rank()) {
    if (!scratch.has_value()) {
      for (int64_t j = 1; j < n_; ++j) {
        at::Tensor part = at::empty(like.sizes(), like.options());
        partial((r_ + j) % n_, part);
        auto [work, sent, recv] = exchange(comm, part, (r_ + j) % n_, (r_ - j + n_) % n_);
        works_.push_back(work);
        received_.push_back(recv);
        sent_.push_back(sent);
      }
      return;
    }
    const at::Tensor slots = window_slots(*scratch, 2 * n_, like, fn);
    const at::Tensor send = slots.narrow(0, 0, n_), recv = slots.narrow(0, n_, n_);
    for (int64_t j = 1; j < n_; ++j) partial((r_ + j) % n_, send.select(0, (r_ + j) % n_));
    // NOTE: slot r of send is not written: the all-to-all copies it to slot r of recv, which nobody reads.
    works_.push_back(comm.all_to_all_single(recv, send, {}, {}, /*async_op=*/true));
    for (int64_t j = 1; j < n_; ++j) received_.push_back(recv.select(0, (r_ - j + n_) % n_));
  }

  at::Tensor add_into(at::Tensor own) {
    for (const auto& work : works_) work->wait(std::nullopt);
    for (const auto& part : received_) own.add_(part);
    return own;
  }

 private:
  const int64_t n_, r_;
  std::vector<std::shared_ptr<Work>> works_;
  std::vector<at::Tensor> received_, sent_;  // sent_: kept until the sends are done (their Work keeps them too)
};

}  // namespace

std::vector<at::Tensor> tp_gather_linears(Communicator& comm, const at::Tensor& x,
                                          const std::vector<at::Tensor>& weights, int64_t seq_dim,
                                          const std::optional<at::Tensor>& scratch) {
  const int64_t n = comm.world_size(), r = comm.rank();
  const at::Tensor xs = x.contiguous();  // (.., s, .., h): this rank's chunk
  // NOTE: x_full is saved for backward: out of a window it is copied (the next op reuses the window).
  NaturalLayout whole(comm, xs, seq_dim, n, /*own_copy=*/scratch.has_value());
  auto [gathered, work] = start_gather(comm, xs, scratch, "tp_gather_linears");
  whole.queue(gathered);  // beside the GEMMs below
  std::vector<at::Tensor> out{at::Tensor()};
  for (const auto& w : weights) {
    out.push_back(at::empty(with_seq_times(xs.sizes(), seq_dim, n, w.size(0)), xs.options()));
    mm_into(seq_chunk(out.back(), seq_dim, n, r), xs, w.t(), false);  // own chunk, beside the all-gather
  }
  work->wait(std::nullopt);
  const auto pieces = gathered.chunk(n, 0);
  for (int64_t j = 0; j < n; ++j) {
    if (j == r) continue;
    for (size_t i = 0; i < weights.size(); ++i) mm_into(seq_chunk(out[i + 1], seq_dim, n, j), pieces[j], weights[i].t(), false);
  }
  out[0] = whole.take(gathered);
  if (scratch.has_value() && out[0].data_ptr() == gathered.data_ptr()) out[0] = out[0].clone();  // not queued
  return out;
}

std::vector<at::Tensor> tp_gather_linears_backward(Communicator& comm, const at::Tensor& x_full,
                                                   const std::vector<at::Tensor>& weights,
                                                   const std::vector<at::Tensor>& grad_ys,
                                                   const std::optional<at::Tensor>& grad_x_full, int64_t seq_dim,
                                                   const std::optional<at::Tensor>& scratch) {
  const int64_t n = comm.world_size(), r = comm.rank();
  // NOTE: each output gradient made contiguous once, for its chunk GEMMs and its weight GEMM alike
  // (q's comes back from attention transposed: a strided chunk per peer and a reshape copied it 3 times).
  std::vector<at::Tensor> gys;
  for (const auto& gy : grad_ys) gys.push_back(gy.contiguous());
  const at::Tensor like = at::empty(seq_chunk(x_full, seq_dim, n, 0).sizes(), x_full.options());
  auto partial_grad_x = [&](int64_t j, at::Tensor out) {  // chunk j of sum_i grad_y_i @ w_i (+ grad_x_full)
    if (grad_x_full.has_value()) out.copy_(seq_chunk(*grad_x_full, seq_dim, n, j));
    for (size_t i = 0; i < weights.size(); ++i) {
      mm_into(out, seq_chunk(gys[i], seq_dim, n, j), weights[i], grad_x_full.has_value() || i > 0);
    }
  };
  // NOTE: peers' chunks first, so the weight GEMMs and our own chunk run while they travel.
  PeerParts peers(comm, like, scratch, "tp_gather_linears_backward", partial_grad_x);
  std::vector<at::Tensor> out{at::Tensor()};
  const at::Tensor x2 = x_full.reshape({-1, x_full.size(-1)});
  for (const auto& gy : gys) out.push_back(at::mm(gy.view({-1, gy.size(-1)}).t(), x2));  // (out/tp, h)
  partial_grad_x(r, like);
  out[0] = peers.add_into(like);
  return out;
}

at::Tensor tp_linear_reduce_scatter(Communicator& comm, const at::Tensor& h, const at::Tensor& weight, int64_t seq_dim,
                                    const std::optional<at::Tensor>& scratch) {
  const int64_t n = comm.world_size(), r = comm.rank();
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end());
  shape[seq_dim] /= n;
  shape.back() = weight.size(0);
  const at::Tensor own = at::empty(shape, h.options());
  // (.., s, .., in/tp) @ (in/tp, out): this rank's part of chunk j's sum
  auto partial = [&](int64_t j, at::Tensor out) {
    mm_into(out, seq_chunk(h, seq_dim, n, j), weight.t(), false);
  };
  PeerParts peers(comm, own, scratch, "tp_linear_reduce_scatter", partial);  // NOTE: peers' chunks first, then ours
  partial(r, own);
  return peers.add_into(own);
}

std::vector<at::Tensor> tp_linear_reduce_scatter_backward(Communicator& comm, const at::Tensor& grad_out,
                                                          const at::Tensor& h, const at::Tensor& weight,
                                                          int64_t seq_dim, const std::optional<at::Tensor>& scratch) {
  const int64_t n = comm.world_size(), r = comm.rank();
  const at::Tensor go = grad_out.contiguous();  // (.., s, .., out): this rank's chunk
  NaturalLayout whole(comm, go, seq_dim, n);  // read within this op only: a view of the window will do
  auto [gathered, work] = start_gather(comm, go, scratch, "tp_linear_reduce_scatter_backward");
  whole.queue(gathered);  // beside the GEMMs below
  at::Tensor grad_h = at::empty(h.sizes(), h.options());
  mm_into(seq_chunk(grad_h, seq_dim, n, r), go, weight, false);  // own chunk beside the all-gather
  work->wait(std::nullopt);
  const auto pieces = gathered.chunk(n, 0);
  for (int64_t j = 0; j < n; ++j) {
    if (j != r) mm_into(seq_chunk(grad_h, seq_dim, n, j), pieces[j], weight, false);  // (.., s, .., out) @ (out, in/tp)
  }
  const at::Tensor grad_full = whole.take(gathered);
  at::Tensor grad_w = at::mm(grad_full.reshape({-1, grad_full.size(-1)}).t(), h.reshape({-1, h.size(-1)}));
  return {grad_h, grad_w};
}

std::vector<at::Tensor> tp_linears_all_reduce_backward(Communicator& comm, const at::Tensor& x,
                                                       const std::vector<at::Tensor>& weights,
                                                       const std::vector<at::Tensor>& grad_ys,
                                                       const std::optional<at::Tensor>& grad_x,
                                                       const std::optional<at::Tensor>& scratch, bool gather) {
  const char* fn = "tp_linears_all_reduce_backward";
  at::Tensor grad = at::empty(x.sizes(), x.options());
  std::optional<Partials> parts;
  if (gather) parts.emplace(comm, scratch, grad, fn);
  at::Tensor sum = parts ? parts->own() : sum_buffer(scratch, grad, fn);
  std::vector<at::Tensor> gys;  // contiguous once, for both GEMMs each
  for (const auto& gy : grad_ys) gys.push_back(gy.contiguous());
  if (grad_x.has_value()) sum.copy_(*grad_x);
  for (size_t i = 0; i < weights.size(); ++i) {  // (.., out_i/tp) @ (out_i/tp, h): this rank's part of the sum
    mm_into(sum, gys[i], weights[i], grad_x.has_value() || i > 0);
  }
  std::vector<std::shared_ptr<Work>> works;
  if (parts) {
    works.push_back(parts->gather());
  } else {
    works.push_back(comm.all_reduce(sum, static_cast<int>(ReduceOp::kSum), true, 1.0));
  }
  std::vector<at::Tensor> out{grad};
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  for (const auto& gy : gys) out.push_back(at::mm(gy.view({-1, gy.size(-1)}).t(), x2));  // beside it
  if (parts) {
    works[0]->wait(std::nullopt);
    parts->sum_into(grad);
  } else {
    finish_sums(comm, works, sum, out[0]);
  }
  return out;
}

at::Tensor tp_linear_all_reduce(Communicator& comm, const at::Tensor& h, const at::Tensor& weight, int64_t chunks,
                                const std::optional<at::Tensor>& scratch, bool gather) {
  const char* fn = "tp_linear_all_reduce";
  PYNCCL_CHECK_VALUE(chunks >= 1, fn, ": chunks must be >= 1, got ", chunks);
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end());
  shape.back() = weight.size(0);
  at::Tensor out = at::empty(shape, h.options());
  const at::Tensor h2 = h.reshape({-1, h.size(-1)});
  const at::Tensor wt = weight.t();
  const int64_t rows = h2.size(0), k = std::max<int64_t>(1, std::min(chunks, rows));
  auto slice = [&](int64_t c) {  // (first row, rows): the same slices as async_tp_allreduce.row_slices
    const int64_t lo = c * rows / k;
    return std::make_pair(lo, (c + 1) * rows / k - lo);
  };
  if (gather) {
    // Each slice's partials, rank after rank, in its own block of the window: slice c's block starts
    // at n * lo elements' rows, so one all-gather of slice c writes every rank's partial of it. Each
    // slice is summed as soon as its gather is done, beside the next slices' gathers.
    const at::Tensor out2 = out.view({-1, weight.size(0)});
    Partials parts(comm, scratch, out, fn);
    std::vector<std::shared_ptr<Work>> works;
    for (int64_t c = 0; c < k; ++c) {
      const auto [lo, n] = slice(c);
      at::Tensor own = parts.own_rows(lo, n);
      at::mm_out(own, h2.narrow(0, lo, n), wt);
      works.push_back(parts.gather_rows(lo, n));  // on the copy engines, beside the next slice's GEMM
    }
    for (int64_t c = 0; c < k; ++c) {
      const auto [lo, n] = slice(c);
      works[c]->wait(std::nullopt);
      parts.sum_rows_into(out2.narrow(0, lo, n), lo, n);
    }
    return out;
  }
  const at::Tensor sum = sum_buffer(scratch, out, fn).view({-1, weight.size(0)});
  std::vector<std::shared_ptr<Work>> works;
  for (int64_t c = 0; c < k; ++c) {
    const auto [lo, n] = slice(c);
    at::Tensor piece = sum.narrow(0, lo, n);
    at::mm_out(piece, h2.narrow(0, lo, n), wt);
    works.push_back(comm.all_reduce(piece, static_cast<int>(ReduceOp::kSum), true, 1.0));  // beside the next slice
  }
  finish_sums(comm, works, sum.view(out.sizes()), out);
  return out;
}

}  // namespace pynccl
