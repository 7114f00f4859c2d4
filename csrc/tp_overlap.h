// Sequence-parallel TP's collective matmuls on NCCL (tp_overlap.cpp): all-gather overlapped with the
// GEMMs of this rank's own sequence chunk, and GEMM partials sent to their peers as they are made.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace pynccl {

class Communicator;

// [x_full, x_full @ w^T for w in weights]; x is this rank's chunk of dim seq_dim.
std::vector<at::Tensor> tp_gather_linears(Communicator& comm, const at::Tensor& x,
                                          const std::vector<at::Tensor>& weights, int64_t seq_dim);
// [grad_x (this rank's chunk, summed over ranks), grad_w for each weight].
std::vector<at::Tensor> tp_gather_linears_backward(Communicator& comm, const at::Tensor& x_full,
                                                   const std::vector<at::Tensor>& weights,
                                                   const std::vector<at::Tensor>& grad_ys,
                                                   const std::optional<at::Tensor>& grad_x_full, int64_t seq_dim);
// This rank's chunk of dim seq_dim of sum over ranks of h @ weight^T.
at::Tensor tp_linear_reduce_scatter(Communicator& comm, const at::Tensor& h, const at::Tensor& weight, int64_t seq_dim);
// [grad_h, grad_w] given this rank's chunk of the output's gradient.
std::vector<at::Tensor> tp_linear_reduce_scatter_backward(Communicator& comm, const at::Tensor& grad_out,
                                                          const at::Tensor& h, const at::Tensor& weight,
                                                          int64_t seq_dim);

}  // namespace pynccl
