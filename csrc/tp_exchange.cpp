// TP's chunk exchanges (tp_exchange.h says what each holds and when the window may be reused).
#include "tp_exchange.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <tuple>

#include "check.h"

namespace pynccl::tp_exchange {

at::Tensor seq_chunk(const at::Tensor& t, int64_t seq_dim, int64_t n, int64_t j) {
  const int64_t s = t.size(seq_dim) / n;
  return t.narrow(seq_dim, j * s, s);
}

std::vector<int64_t> with_seq_times(c10::IntArrayRef shape, int64_t seq_dim, int64_t n, int64_t last) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  out[seq_dim] *= n;
  if (last >= 0) out.back() = last;
  return out;
}

cudaStream_t caller_stream(const Communicator& comm) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(comm.device())).stream();
}

cudaStream_t comm_stream_of(const Communicator& comm) { return reinterpret_cast<cudaStream_t>(comm.stream_handle()); }

namespace {

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

// Sends `part` to rank `to` and receives the same shape from `frm`, in one NCCL group: (work, received).
std::pair<std::shared_ptr<Work>, at::Tensor> exchange(Communicator& comm, const at::Tensor& part, int64_t to,
                                                      int64_t frm) {
  at::Tensor recv = at::empty_like(part);
  auto work = comm.batch_isend_irecv({std::make_tuple(true, part, to), std::make_tuple(false, recv, frm)});
  return {work, recv};
}

}  // namespace

NaturalLayout::NaturalLayout(Communicator& comm, const at::Tensor& local, int64_t seq_dim, int64_t n, bool own_copy)
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

NaturalLayout::~NaturalLayout() {
  try {
    join();
  } catch (...) {
  }
}

void NaturalLayout::queue(const at::Tensor& gathered) {
  if (!whole_.has_value()) return;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(comm_.device()));
  const cudaStream_t comm_stream = comm_stream_of(comm_);
  char* const dst = static_cast<char*>(whole_->data_ptr());
  const char* const src = static_cast<const char*>(gathered.data_ptr());
  if (outer_ == 1) {  // the layouts agree: one copy
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

at::Tensor NaturalLayout::take(const at::Tensor& gathered) {
  if (!queued_) return natural(gathered, local_, seq_dim_, n_);
  join();
  return *whole_;
}

void NaturalLayout::join() {
  if (!queued_) return;
  queued_ = false;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(comm_.device()));
  comm_.order_after(caller_stream(comm_), comm_stream_of(comm_));
}

at::Tensor sum_buffer(const std::optional<at::Tensor>& scratch, const at::Tensor& out, const char* fn) {
  if (!scratch.has_value()) return out;
  const int64_t nbytes = out.numel() * static_cast<int64_t>(out.element_size());
  PYNCCL_CHECK_VALUE(scratch->scalar_type() == at::kByte && scratch->dim() == 1 && scratch->numel() >= nbytes, fn,
                     ": scratch must be a 1-D uint8 window of at least ", nbytes, " bytes, got ", scratch->dim(),
                     "-D with ", scratch->numel(), " elements of ", std::string(c10::toString(scratch->scalar_type())));
  return scratch->narrow(0, 0, nbytes).view(out.scalar_type()).view(out.sizes());
}

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

Partials::Partials(Communicator& comm, const std::optional<at::Tensor>& scratch, const at::Tensor& like,
                   const char* fn)
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

std::shared_ptr<Work> Partials::gather_rows(int64_t lo, int64_t m) {
  return comm_.all_gather_into_tensor(win_.narrow(0, n_ * lo, n_ * m), own_rows(lo, m), /*async_op=*/true);
}

void Partials::sum_rows_into(const at::Tensor& out, int64_t lo, int64_t m) const {
  const at::Tensor block = win_.narrow(0, n_ * lo, n_ * m).view({n_, m, cols_});
  at::Tensor o = out.view({m, cols_});
  if (n_ == 2) {
    at::add_out(o, block[0], block[1]);
  } else {
    at::sum_out(o, block, {0});
  }
}

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

std::pair<at::Tensor, std::shared_ptr<Work>> start_gather(Communicator& comm, const at::Tensor& local,
                                                          const std::optional<at::Tensor>& scratch, const char* fn) {
  const int64_t n = comm.world_size();
  if (!scratch.has_value()) {
    at::Tensor gathered = gather_buffer(local, n);
    return {gathered, comm.all_gather_into_tensor(gathered, local, /*async_op=*/true)};
  }
  const at::Tensor slots = window_slots(*scratch, n, local, fn);
  const at::Tensor mine = slots.select(0, comm.rank());
  const cudaStream_t comm_stream = comm_stream_of(comm);
  if (comm_stream == nullptr) {
    mine.copy_(local);
  } else {
    const auto device = static_cast<c10::DeviceIndex>(comm.device());
    const c10::cuda::CUDAGuard guard(device);
    comm.order_after(comm_stream, caller_stream(comm));  // `local` is made, the window's last reader done
    {
      const c10::cuda::CUDAStreamGuard on_comm(c10::cuda::getStreamFromExternal(comm_stream, device));
      mine.copy_(local);
    }
    try {
      return {slots.flatten(0, 1), comm.all_gather_into_tensor(slots, mine, /*async_op=*/true)};
    } catch (...) {
      // NOTE: no Work for the caller to wait on: its stream waits for the copy here, before `local`
      // can go back to the allocator and a caller kernel reuse it under the pending read.
      comm.order_after(caller_stream(comm), comm_stream);
      throw;
    }
  }
  return {slots.flatten(0, 1), comm.all_gather_into_tensor(slots, mine, /*async_op=*/true)};
}

PeerParts::PeerParts(Communicator& comm, const at::Tensor& like, const std::optional<at::Tensor>& scratch,
                     const char* fn, const std::function<void(int64_t, at::Tensor)>& partial)
    : n_(comm.world_size()), r_(comm.rank()) {
  if (!scratch.has_value()) {
    for (int64_t j = 1; j < n_; ++j) {
      at::Tensor part = at::empty(like.sizes(), like.options());
      partial((r_ + j) % n_, part);
      auto [work, recv] = exchange(comm, part, (r_ + j) % n_, (r_ - j + n_) % n_);
      works_.push_back(work);
      received_.push_back(recv);
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

at::Tensor PeerParts::add_into(at::Tensor own) {
  for (const auto& work : works_) work->wait(std::nullopt);
  for (const auto& part : received_) own.add_(part);
  return own;
}

}  // namespace pynccl::tp_exchange
