// What the decode-size kernels (gemv.cu, norm.cu) share: Hopper's programmatic dependent launch (PDL) and L2
// prefetch, each a no-op before sm_90, and an L1 prefetch.
//
// A kernel launched with programmatic stream serialization may start its blocks while the kernel before it still
// runs: nothing that kernel writes may be read, and nothing written, before ``wait_for_previous_kernel`` (which
// returns once that kernel has finished and its writes are visible). A kernel lets the one after it start by
// ``let_next_kernel_start`` (else only at its end).
#pragma once
#include <stdint.h>

namespace banyan {

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ``bytes`` (a multiple of 16) at ``p`` into L2, with no register held (Hopper's bulk prefetch).
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

}  // namespace banyan
