// RMSNorm at decode batch sizes, with the residual added first: for each of the M rows (a block each)
//   s = x + residual (rounded to T: the new residual stream),  out = weight * T(s / sqrt(mean(s^2) + eps))
// as the PyTorch reference computes it (ops._torch_fused_add_rmsnorm; without a residual s = x). Built into the
// same library as gemv.cu (kernels/cuda_gemv.py).
//
// Why: in the batch-1 decode step FlashInfer's fused add-RMSNorm took 3.8 us a call in the CUDA graph (64 calls,
// 8 % of the FP8 step, H200 2026-12-03): a latency-bound single block that loops. Here
// each thread holds V 16-byte vectors of the row in registers (one read of x, residual and weight — the weight read
// before the wait for the kernel before), one block reduction, one write. Launched with PDL, it lets the linear
// after it start at once (its blocks prefetch their weights while this runs) and waits for the kernel before it
// only when it reads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemv_parts.cuh"
#include "pdl.cuh"

namespace {

using banyan::from_f;
using banyan::to_f;

// grid (M), block (threads: a multiple of 32, threads * 8 * V >= K), K a multiple of 8, rows 16-byte aligned.
template <bool BF16, int V>
__global__ void add_rmsnorm_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ res,
                                   const uint16_t* __restrict__ w, uint16_t* __restrict__ out,
                                   uint16_t* __restrict__ res_out, int K, long ldx, long ldr, long ldo, long ldro,
                                   float eps) {
  // the norm's weight first: no kernel writes it, so its loads go out before the wait for the kernel before (with
  // PDL, while that one drains), not one round trip after the reduction (up to K = 16,384: V = 4's rows would spill)
  constexpr bool EARLY = V <= 2;
  uint4 wv[EARLY ? V : 1];
  if constexpr (EARLY) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int k = (i * blockDim.x + threadIdx.x) * 8;
      if (k < K) wv[i] = *reinterpret_cast<const uint4*>(w + k);
    }
  }
  banyan::let_next_kernel_start();  // (the linear after it may start: it reads nothing of ours before its wait)
  banyan::wait_for_previous_kernel();
  const int row = blockIdx.x;
  float s[V][8];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int k = (i * blockDim.x + threadIdx.x) * 8;
    if (k >= K) break;
    uint4 xv = *reinterpret_cast<const uint4*>(x + row * ldx + k);
    const uint16_t* xe = reinterpret_cast<const uint16_t*>(&xv);
    if (res != nullptr) {
      const uint4 rv = *reinterpret_cast<const uint4*>(res + row * ldr + k);
      const uint16_t* re = reinterpret_cast<const uint16_t*>(&rv);
      uint4 sv;
      uint16_t* se = reinterpret_cast<uint16_t*>(&sv);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        se[j] = from_f<BF16>(to_f<BF16>(xe[j]) + to_f<BF16>(re[j]));
        s[i][j] = to_f<BF16>(se[j]);
      }
      *reinterpret_cast<uint4*>(res_out + row * ldro + k) = sv;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) s[i][j] = to_f<BF16>(xe[j]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += s[i][j] * s[i][j];
  }
  __shared__ float part[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < warps; ++i) total += part[i];  // (every thread, the same order: the same bits)
  const float inv = rsqrtf(total / K + eps);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int k = (i * blockDim.x + threadIdx.x) * 8;
    if (k >= K) break;
    uint4 wk;
    if constexpr (EARLY) wk = wv[i];
    else wk = *reinterpret_cast<const uint4*>(w + k);
    const uint16_t* we = reinterpret_cast<const uint16_t*>(&wk);
    uint4 ov;
    uint16_t* oe = reinterpret_cast<uint16_t*>(&ov);
#pragma unroll
    for (int j = 0; j < 8; ++j) oe[j] = from_f<BF16>(to_f<BF16>(we[j]) * to_f<BF16>(from_f<BF16>(s[i][j] * inv)));
    *reinterpret_cast<uint4*>(out + row * ldo + k) = ov;
  }
}

}  // namespace

#ifndef BANYAN_GEMV_BF16
#define BANYAN_GEMV_BF16 1
#endif
// -> 0, -1 for a shape not taken (K not a multiple of 8 or over 32768, the other activation type), or a CUDA error.
extern "C" int banyan_add_rmsnorm(const void* x, const void* res, const void* w, void* out, void* res_out, int M,
                                  int K, long ldx, long ldr, long ldo, long ldro, float eps, int act_bf16, int pdl,
                                  void* stream) {
  constexpr bool BF16 = BANYAN_GEMV_BF16 != 0;
  if (M < 1 || K < 8 || K % 8 != 0 || K > 32768 || (act_bf16 != 0) != BF16) return -1;
  const int vectors = K / 8;
  const int v = vectors <= 1024 ? 1 : vectors <= 2048 ? 2 : 4;
  const int threads = ((vectors + v - 1) / v + 31) / 32 * 32;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(M);
  cfg.blockDim = dim3(threads);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const auto* xp = static_cast<const uint16_t*>(x);
  const auto* rp = static_cast<const uint16_t*>(res);
  const auto* wp = static_cast<const uint16_t*>(w);
  auto* op = static_cast<uint16_t*>(out);
  auto* rop = static_cast<uint16_t*>(res_out);
  cudaError_t err;
  if (v == 1) err = cudaLaunchKernelEx(&cfg, add_rmsnorm_kernel<BF16, 1>, xp, rp, wp, op, rop, K, ldx, ldr, ldo, ldro, eps);
  else if (v == 2) err = cudaLaunchKernelEx(&cfg, add_rmsnorm_kernel<BF16, 2>, xp, rp, wp, op, rop, K, ldx, ldr, ldo, ldro, eps);
  else err = cudaLaunchKernelEx(&cfg, add_rmsnorm_kernel<BF16, 4>, xp, rp, wp, op, rop, K, ldx, ldr, ldo, ldro, eps);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(cudaGetLastError());
}
