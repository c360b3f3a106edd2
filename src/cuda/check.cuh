// Every CUDA runtime call and every launch goes through these checks.
#pragma once
#include <cuda_runtime.h>

#include "expertqmm/error.h"

#define EXPERTQMM_CUDA_CHECK(call)                                                         \
  do {                                                                                     \
    cudaError_t err_ = (call);                                                             \
    if (err_ != cudaSuccess)                                                               \
      throw ::expertqmm::Error("cuda", ::expertqmm::detail::cat(#call, " failed: ",        \
                                                                cudaGetErrorString(err_), " at ", \
                                                                __FILE__, ":", __LINE__));  \
  } while (0)

// After each <<<...>>>: catches bad launch configurations at once.
#define EXPERTQMM_CUDA_CHECK_LAUNCH(kernel_name) \
  EXPERTQMM_CUDA_CHECK(cudaPeekAtLastError())
