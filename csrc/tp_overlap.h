// TP's collective matmuls on NCCL (tp_overlap.cpp). Sequence parallel: all-gather overlapped with the
// GEMMs of this rank's own sequence chunk, and GEMM partials sent to their peers as they are made.
// Without it: the input gradient's all-reduce beside the weight GEMMs, and a row-parallel GEMM's
// all-reduce pipelined over token slices.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace pynccl {

class Communicator;

// scratch (each op below): none, or a symmetric window (uint8) the op's all-gather or all-to-all
// runs in (on the copy engines where the communicator has them): world_size x the chunk's bytes for
// a gather, 2 x world_size x them for the partials' all-to-all; without it, NCCL's all-gather into
// ordinary memory and a ring of send/recv pairs.
// [x_full, x_full @ w^T for w in weights]; x is this rank's chunk of dim seq_dim.
std::vector<at::Tensor> tp_gather_linears(Communicator& comm, const at::Tensor& x,
                                          const std::vector<at::Tensor>& weights, int64_t seq_dim,
                                          const std::optional<at::Tensor>& scratch);
// [grad_x (this rank's chunk, summed over ranks), grad_w for each weight].
std::vector<at::Tensor> tp_gather_linears_backward(Communicator& comm, const at::Tensor& x_full,
                                                   const std::vector<at::Tensor>& weights,
                                                   const std::vector<at::Tensor>& grad_ys,
                                                   const std::optional<at::Tensor>& grad_x_full, int64_t seq_dim,
                                                   const std::optional<at::Tensor>& scratch);
// This rank's chunk of dim seq_dim of sum over ranks of h @ weight^T.
at::Tensor tp_linear_reduce_scatter(Communicator& comm, const at::Tensor& h, const at::Tensor& weight, int64_t seq_dim,
                                    const std::optional<at::Tensor>& scratch);
// [grad_h, grad_w] given this rank's chunk of the output's gradient.
std::vector<at::Tensor> tp_linear_reduce_scatter_backward(Communicator& comm, const at::Tensor& grad_out,
                                                          const at::Tensor& h, const at::Tensor& weight,
                                                          int64_t seq_dim, const std::optional<at::Tensor>& scratch);


// [sum over ranks of (grad_x + sum_i grad_y_i @ w_i), grad_y_i^T @ x for each i]. scratch: a
// symmetric window (uint8, at least x's bytes) the sum is computed and reduced in, or none. gather:
// instead every rank's partial is all-gathered into scratch (world_size x x's bytes; on the copy
// engines where the communicator has them) and summed locally, in rank order.
std::vector<at::Tensor> tp_linears_all_reduce_backward(Communicator& comm, const at::Tensor& x,
                                                       const std::vector<at::Tensor>& weights,
                                                       const std::vector<at::Tensor>& grad_ys,
                                                       const std::optional<at::Tensor>& grad_x,
                                                       const std::optional<at::Tensor>& scratch, bool gather);
// sum over ranks of h @ weight^T, in `chunks` token slices, each slice's all-reduce started when it is
// computed. scratch, gather: as above (the output's bytes, or world_size x them).
at::Tensor tp_linear_all_reduce(Communicator& comm, const at::Tensor& h, const at::Tensor& weight, int64_t chunks,
                                const std::optional<at::Tensor>& scratch, bool gather);

}  // namespace pynccl
