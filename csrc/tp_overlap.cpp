// TP's collective matmuls on NCCL (pynccl/tensor_parallel/async_tp.py's and async_tp_allreduce.py's ops):
// the same decomposition as the Python reference there, one C++ call per op. The Python one paid
// ~20 µs of host per launch on 2×H200's hosts, twice the launches of the plain path, and a
// compiled Llama 1.1B step became host-bound (RESULTS, tensor parallelism, session 19).
//
// How the chunks move between ranks is tp_exchange.{h,cpp}'s. Chunk views of [b, s, h] tensors are
// strided and go through bmm with the batch stride as it is (no copy).
#include <ATen/ATen.h>

#include <optional>
#include <utility>
#include <vector>

#include "check.h"
#include "communicator.h"
#include "dtypes.h"
#include "tp_exchange.h"
#include "tp_overlap.h"
#include "work.h"

namespace pynccl {
namespace {

using tp_exchange::finish_sums;
using tp_exchange::NaturalLayout;
using tp_exchange::Partials;
using tp_exchange::PeerParts;
using tp_exchange::seq_chunk;
using tp_exchange::start_gather;
using tp_exchange::sum_buffer;
using tp_exchange::with_seq_times;

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
