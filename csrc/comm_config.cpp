// How a communicator is configured from its CommOptions and the environment: ncclConfig_t
// (blocking mode, CTA limits and policy, name) and the integer PYNCCL_* settings. Kept apart from
// the life cycle in communicator.cpp so each file holds one job.
#include "comm_config.h"

#include <cstdlib>

#include "check.h"
#include "nccl_api.h"

namespace pynccl {
namespace {

// ncclConfig_t.CTAPolicy from PYNCCL_NCCL_CTA_POLICY (0 default, 1 efficiency, 2 zero), else
// `default_policy` (-1: leave NCCL's); an error where the headers or the loaded library predate
// the field (2.27).
int cta_policy_from_env(int default_policy) {
  const int policy = env_int("PYNCCL_NCCL_CTA_POLICY", default_policy);
  if (policy < 0) return -1;
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 27, 0)
  PYNCCL_CHECK_VALUE(false, "CTA policy ", policy, " (cta_policy= or PYNCCL_NCCL_CTA_POLICY): ncclConfig_t.CTAPolicy "
                     "needs NCCL >= 2.27 headers, "
                     "pynccl was built with ", nccl_version_string(NCCL_VERSION_CODE));
#endif
  PYNCCL_CHECK_VALUE(nccl_runtime_version() >= kCtaPolicyVersion, "CTA policy ", policy,
                     " (cta_policy= or PYNCCL_NCCL_CTA_POLICY): ncclConfig_t.CTAPolicy needs NCCL >= 2.27 at run time, the loaded library is ",
                     nccl_version_string(nccl_runtime_version()));
  return policy;
}

}  // namespace

int env_int(const char* name, int default_value) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return default_value;
  return std::atoi(value);
}

// NOTE: PYNCCL_NCCL_{CGA_CLUSTER_SIZE,MIN_CTAS,MAX_CTAS,CTA_POLICY}, read here at every init and
// split, override `options` for the communicators made while they are set: NCCL reads its own
// NCCL_* variables once per process, so this is how one process A/Bs them (ddp_bench --levers).
ncclConfig_t make_config(CommOptions& options) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = options.blocking ? 1 : 0;
  const int cga_cluster_size = env_int("PYNCCL_NCCL_CGA_CLUSTER_SIZE", options.cga_cluster_size);
  const int min_ctas = env_int("PYNCCL_NCCL_MIN_CTAS", options.min_ctas);
  const int max_ctas = env_int("PYNCCL_NCCL_MAX_CTAS", options.max_ctas);
  if (cga_cluster_size >= 0) config.cgaClusterSize = cga_cluster_size;
  // NOTE: checked here, before NCCL sees them: NCCL 2.28.9 rejects minCTAs without maxCTAs (it
  // compares against the unset value), and a split it rejects this way leaves the parent holding
  // freed memory (its child abort flag; init.cc's ncclCommInitChildComm), which crashed a process
  // at exit (session 15, 4xH100, PYNCCL_NCCL_MIN_CTAS=16 alone).
  PYNCCL_CHECK_VALUE(min_ctas <= 0 || max_ctas > 0, "minCTAs ", min_ctas,
                     " (min_ctas= or PYNCCL_NCCL_MIN_CTAS) needs maxCTAs as well (max_ctas= or PYNCCL_NCCL_MAX_CTAS): "
                     "NCCL rejects one without the other");
  PYNCCL_CHECK_VALUE(min_ctas <= 0 || min_ctas <= max_ctas, "minCTAs ", min_ctas, " is above maxCTAs ", max_ctas,
                     " (min_ctas=/max_ctas= or PYNCCL_NCCL_MIN_CTAS/PYNCCL_NCCL_MAX_CTAS)");
  if (min_ctas > 0) config.minCTAs = min_ctas;
  if (max_ctas > 0) config.maxCTAs = max_ctas;
  const int cta_policy = cta_policy_from_env(options.cta_policy);
  options.cta_policy = cta_policy;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  if (cta_policy >= 0) config.CTAPolicy = cta_policy;
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  // NOTE: points into options.name, which outlives the init call.
  config.commName = options.name.c_str();
#endif
  return config;
}

}  // namespace pynccl
