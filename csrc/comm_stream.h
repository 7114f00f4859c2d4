// Which CUDA stream a communicator's ops run on (comm_stream.cpp): one no other live communicator
// of the device uses. torch's stream pool hands out 32 streams per priority round-robin, shared
// with torch.cuda.Stream() and other libraries, so two communicators made 32·k draws apart would
// otherwise share one, and their collectives would queue behind each other.
#pragma once

#include <cuda_runtime.h>

#include <c10/cuda/CUDAStream.h>

namespace pynccl {

// A pool stream (high or normal priority) no live communicator on `device` holds, else (after one
// round of the pool) a stream of its own, never destroyed: a torch.cuda.Stream of it may outlive
// the communicator. Held until release_stream.
c10::cuda::CUDAStream unshared_stream(bool high_priority, int device);

// Gives `s` back (the communicator that held it is gone).
void release_stream(int device, cudaStream_t s);

}  // namespace pynccl
