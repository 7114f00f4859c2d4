"""The two backends behind one interface (see base.Backend): "nccl" (C++ Communicator,
CUDA tensors) and "gloo" (torch.distributed's gloo process group, CPU tensors)."""
