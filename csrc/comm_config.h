// Communicator configuration: ncclConfig_t from CommOptions and PYNCCL_NCCL_* variables
// (comm_config.cpp), and the integer PYNCCL_* settings read at construction.
#pragma once

#include <nccl.h>

#include "communicator.h"

namespace pynccl {

// PYNCCL_* integer setting `name`, or `default_value` when unset or empty.
int env_int(const char* name, int default_value);

// The ncclConfig_t of a communicator made with `options`; PYNCCL_NCCL_{CGA_CLUSTER_SIZE,MIN_CTAS,
// MAX_CTAS,CTA_POLICY} override them (ValueError for a CTA policy the NCCL in use lacks).
// options.cta_policy is set to the policy in effect (-1: NCCL's default).
ncclConfig_t make_config(CommOptions& options);

}  // namespace pynccl
