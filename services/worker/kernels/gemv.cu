// Linear layers at decode batch sizes (M <= 8 rows of x): y = x W^T (x per-row scale), streaming W once.
// Built at start-up by kernels/cuda_gemv.py (nvcc, cached) and called through ctypes on torch's stream;
// used only for the weight shapes where kernels/small_m.tune measured it correct and faster.
//
// Why a CUDA kernel beside the Triton ones: e4m3 weights must be widened before any bf16/fp16 product,
// and the conversion instructions (cvt: e4m3x2 -> f16x2, then f16 -> f32 -> bf16) run on the narrow
// conversion pipe: at M = 1 the Triton kernels read FP8 weights at 37-64 % of HBM bandwidth, no faster
// than bf16 tiles of the same shape. Here the widening is integer work only: PRMT replicates each byte's
// sign over a 16-bit half, a shift places exponent and mantissa, a mask keeps one sign bit: 3 integer
// instructions a pair of weights, exact for every e4m3 value, subnormals included, as the bit pattern of
// value x 2^-120 (bf16) or x 2^-8 (f16); the power of two is folded back after the products.
//
// The products are tensor-core mma.sync m16n8k16 with the weight as the A operand (16 rows x 16 k) and
// x^T as B (16 k x 8 columns: the M <= 8 rows of x, zero-padded; the code takes NT such tiles, built for
// one). The order of k inside an mma is free as long as A and B agree, so each lane loads 16 contiguous
// bytes of its weight rows and the matching 16 or 32 bytes of x: every load is a 16-byte vector. A block
// of KW warps takes 16 weight rows; each warp a contiguous part of K; the warps' partial sums are added in
// a fixed order (the same bits every run, whatever M). Options: chunks prefetched into L2 ahead of their
// loads; a launch that overlaps the kernel before (PDL); silu(gate) * up made in the kernel (M <= 2); the next
// linear's weight prefetched into L2 once this one's loads are issued.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pdl.cuh"

namespace {
using banyan::let_next_kernel_start;
using banyan::prefetch_l2;
using banyan::wait_for_previous_kernel;

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(0u), "r"(sel));
  return r;
}

// Four e4m3 bytes -> two pairs of 16-bit floats (bytes 0,1 in lo; 2,3 in hi), low element in the low half.
template <bool BF16>
__device__ __forceinline__ void widen4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t s01 = prmt(w, 0x9180u);  // halves: byte 0, byte 1, each sign-extended to 16 bits
  const uint32_t s23 = prmt(w, 0xB3A2u);
  if (BF16) {  // sign at 15, exponent|mantissa at 4..10: value x 2^-120
    lo = (s01 << 4) & 0x87F087F0u;
    hi = (s23 << 4) & 0x87F087F0u;
  } else {  // sign at 15, exponent|mantissa at 7..13: value x 2^-8
    lo = (s01 << 7) & 0xBF80BF80u;
    hi = (s23 << 7) & 0xBF80BF80u;
  }
}

__device__ __forceinline__ uint4 load_stream(const void* p) {  // a weight: read once, kept out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The block's share of the next linear's weight (``pf``, ``pf_bytes``: the layer after this one in the decode
// step, set by cuda_gemv.chain) into L2, issued when the block's own loads are: those bytes come in while the
// kernels between the two (norm, rope, attention: latency-bound, little traffic) run, so the next linear reads
// them from L2, not from HBM. (Opt-in: 30 MiB links measured slower, docs/perf.md.)
__device__ __forceinline__ void prefetch_next_weight(const uint8_t* pf, long pf_bytes) {
  const long per = ((pf_bytes + gridDim.x - 1) / gridDim.x + 15) & ~15L;
  const long hi = min(pf_bytes, (long)(blockIdx.x + 1) * per);
  for (long o = (long)blockIdx.x * per + (long)threadIdx.x * 4096; o < hi; o += (long)blockDim.x * 4096)
    prefetch_l2(pf + o, (int)min(4096L, hi - o));
}

__device__ __forceinline__ uint4 load_x(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <bool BF16>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t& word_ref(uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// silu(gate) * up of a pair of 16-bit values each (float32 math, rounded to T as SiluAndMul rounds it)
template <bool BF16>
__device__ __forceinline__ uint32_t silu_mul2(uint32_t gate, uint32_t up) {
  float g[2], u[2];
  if (BF16) {
    const float2 gf = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&gate));
    const float2 uf = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&up));
    g[0] = gf.x; g[1] = gf.y; u[0] = uf.x; u[1] = uf.y;
  } else {
    const float2 gf = __half22float2(*reinterpret_cast<__half2*>(&gate));
    const float2 uf = __half22float2(*reinterpret_cast<__half2*>(&up));
    g[0] = gf.x; g[1] = gf.y; u[0] = uf.x; u[1] = uf.y;
  }
  const float a0 = g[0] / (1.f + expf(-g[0])) * u[0], a1 = g[1] / (1.f + expf(-g[1])) * u[1];
  uint32_t r;
  if (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a0, a1);
    r = *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(a0, a1);
    r = *reinterpret_cast<uint32_t*>(&v);
  }
  return r;
}

// U steps of one warp from step s0: the loads of all U first (16 bytes each), then the products.
// SILU (M <= 2, NT = 1): x is [gate | up] (M, 2K); the activation of the step's M x STEP values is spread over
// the warp (lane p makes the pair at k 2p: 32 pairs a row for e4m3, 16 for T) and handed to the lanes that
// multiply it by shuffles — 2 exponentials a lane and row, where each consumer lane making its own 16 would
// keep the warp's special-function unit busy longer than its loads.
template <bool FP8, bool BF16, int NT, int U, bool SILU>
__device__ __forceinline__ void run_steps(float (&acc)[NT][4], const uint8_t* wa, const uint8_t* wb,
                                          const uint16_t* const (&xr)[NT], const bool (&xin)[NT], int s0,
                                          const uint16_t* xs, long ldx, int M, int K) {
  constexpr int E = FP8 ? 16 : 8;  // weight elements a lane reads per row and step (16 bytes)
  constexpr int STEP = 4 * E;      // k per step (a warp: 16 rows x STEP k)
  constexpr int XV = FP8 ? 2 : 1;  // 16-byte vectors of x a lane reads per step
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // x scaled by 2^64 when e4m3 weights are widened as bf16 x 2^-120 (products stay far from subnormals)
  const __nv_bfloat162 x_up = __floats2bfloat162_rn(18446744073709551616.f, 18446744073709551616.f);
  uint4 va[U], vb[U], vx[NT][U][XV];
  uint32_t gate[SILU ? U : 1][2], up[SILU ? U : 1][2];
  const int lane = threadIdx.x & 31;
  const int pk = 2 * (FP8 ? lane : (lane & 15));  // (SILU) the pair this lane makes, its k in the step
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long off = (long)(s0 + u) * STEP * (FP8 ? 1 : 2);
    va[u] = load_stream(wa + off);
    vb[u] = load_stream(wb + off);
    if (SILU) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint16_t* at = xs + (long)r * ldx + (long)(s0 + u) * STEP + pk;
        gate[u][r] = r < M ? __ldg(reinterpret_cast<const unsigned int*>(at)) : 0u;
        up[u][r] = r < M ? __ldg(reinterpret_cast<const unsigned int*>(at + K)) : 0u;
      }
    } else {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int h = 0; h < XV; ++h) vx[n][u][h] = xin[n] ? load_x(xr[n] + (long)(s0 + u) * STEP + h * 8) : zero;
    }
  }
  if (SILU) {  // consumer lane (g, t) takes pair i of its 16-byte x vector(s) from lane (E / 2) t + i
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t act0 = silu_mul2<BF16>(gate[u][0], up[u][0]);
      const uint32_t act1 = M > 1 ? silu_mul2<BF16>(gate[u][1], up[u][1]) : 0u;
#pragma unroll
      for (int i = 0; i < E / 2; ++i) {
        const int src = (E / 2) * t + i;
        const uint32_t v0 = __shfl_sync(0xffffffffu, act0, src);
        const uint32_t v1 = __shfl_sync(0xffffffffu, act1, src);
        word_ref(vx[0][u][i / 4], i % 4) = g == 0 ? v0 : g == 1 && M > 1 ? v1 : 0u;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < E / 4; ++j) {  // one mma per 4 of the lane's k (16 k across the group)
      uint32_t a0, a1, a2, a3;  // rows g, g+8 at logical k 2t..2t+1 (a0, a1) and 2t+8..2t+9 (a2, a3)
      if (FP8) {
        widen4<BF16>(word(va[u], j), a0, a2);
        widen4<BF16>(word(vb[u], j), a1, a3);
      } else {
        a0 = word(va[u], 2 * j); a2 = word(va[u], 2 * j + 1);
        a1 = word(vb[u], 2 * j); a3 = word(vb[u], 2 * j + 1);
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const uint4& xv = vx[n][u][FP8 ? j / 2 : 0];
        const int base = FP8 ? (j % 2) * 2 : 2 * j;
        uint32_t b0 = word(xv, base), b1 = word(xv, base + 1);
        if (FP8 && BF16) {
          __nv_bfloat162 p0 = *reinterpret_cast<__nv_bfloat162*>(&b0), p1 = *reinterpret_cast<__nv_bfloat162*>(&b1);
          p0 = __hmul2(p0, x_up);
          p1 = __hmul2(p1, x_up);
          b0 = *reinterpret_cast<uint32_t*>(&p0);
          b1 = *reinterpret_cast<uint32_t*>(&p1);
        }
        mma<BF16>(acc[n], a0, a1, a2, a3, b0, b1);
      }
    }
  }
}

// x (M, K) in T (bf16 if BF16 else f16, rows ldx apart), W (N, K) e4m3 (FP8) or T, scale (N) float or
// null, y (M, N) in T (rows ldy apart). K a multiple of the step (64 k for e4m3, 32 for T), pointers and
// row strides 16-byte aligned (checked by the caller).
// Lane (g = lane / 4, t = lane % 4) reads, per step, 16 bytes of weight rows g and g + 8 of the block's
// tile (a row past N reads row N - 1, its sums never stored) and the same k of x row g (and x row g + 8
// for the second column tile; rows of x past M are zeros).
template <bool FP8, bool BF16, int NT, int KW, int U, bool PF, bool SILU>
__global__ void __launch_bounds__(32 * KW) gemv_kernel(const void* __restrict__ x, const uint8_t* __restrict__ w,
                                                       const float* __restrict__ scale, void* __restrict__ y,
                                                       int M, int N, int K, long ldx, long ldy, float post,
                                                       int ahead, const uint8_t* __restrict__ pf, long pf_bytes) {
  constexpr int E = FP8 ? 16 : 8;
  constexpr int STEP = 4 * E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int steps = K / STEP;
  const int per_warp = (steps + KW - 1) / KW;
  const int s_lo = min(steps, warp * per_warp), s_hi = min(steps, s_lo + per_warp);
  const long wrow = (long)K * (FP8 ? 1 : 2);
  const uint8_t* wa = w + min(row0 + g, N - 1) * wrow + t * 16;
  const uint8_t* wb = w + min(row0 + g + 8, N - 1) * wrow + t * 16;
  const uint16_t* xs = static_cast<const uint16_t*>(x);
  bool xin[NT];
  const uint16_t* xr[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    xin[n] = n * 8 + g < M;
    xr[n] = xs + (long)(n * 8 + g) * ldx + t * E;
  }
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
  // ``ahead`` chunks of U steps prefetched into L2 before they are loaded: lanes t = 0 each take two rows
  const uint8_t* pa = wa - t * 16;
  const uint8_t* pb = wb - t * 16;
  auto fetch = [&](int s) {
    if (t == 0 && s < s_hi) {
      const int bytes = min(U, s_hi - s) * STEP * (FP8 ? 1 : 2);
      prefetch_l2(pa + (long)s * STEP * (FP8 ? 1 : 2), bytes);
      prefetch_l2(pb + (long)s * STEP * (FP8 ? 1 : 2), bytes);
    }
  };
  int s0 = s_lo;
  if (PF) {  // (a kernel of its own: the loop without prefetches is compiled as it was measured)
    for (int c = 0; c < ahead; ++c) fetch(s_lo + c * U);
    wait_for_previous_kernel();
    for (; s0 + U <= s_hi; s0 += U) {
      fetch(s0 + ahead * U);
      run_steps<FP8, BF16, NT, U, SILU>(acc, wa, wb, xr, xin, s0, xs, ldx, M, K);
    }
  } else {
    wait_for_previous_kernel();
    for (; s0 + U <= s_hi; s0 += U) run_steps<FP8, BF16, NT, U, SILU>(acc, wa, wb, xr, xin, s0, xs, ldx, M, K);
  }
  for (; s0 < s_hi; ++s0) run_steps<FP8, BF16, NT, 1, SILU>(acc, wa, wb, xr, xin, s0, xs, ldx, M, K);
  let_next_kernel_start();
  if (pf_bytes > 0) prefetch_next_weight(pf, pf_bytes);

  __shared__ float part[KW][NT][4][32];
#pragma unroll
  for (int n = 0; n < NT; ++n)
    for (int i = 0; i < 4; ++i) part[warp][n][i][lane] = acc[n][i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = part[0][n][i][lane];
#pragma unroll
      for (int q = 1; q < KW; ++q) v += part[q][n][i][lane];  // (in order: the same sum every run)
      const int row = row0 + g + (i >= 2 ? 8 : 0);
      const int m = n * 8 + 2 * t + (i & 1);
      if (row < N && m < M) {
        v *= post;
        if (scale != nullptr) v *= scale[row];
        if (BF16) static_cast<__nv_bfloat16*>(y)[(long)m * ldy + row] = __float2bfloat16_rn(v);
        else static_cast<__half*>(y)[(long)m * ldy + row] = __float2half_rn(v);
      }
    }
  }
}

template <typename... Params, typename... Args>
int launch(void (*kernel)(Params...), dim3 grid, int threads, cudaStream_t st, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <bool FP8, bool BF16, int NT, bool SILU>
int launch_kw_u(int kw, int unroll, int ahead, bool pdl, dim3 grid, cudaStream_t st, const void* x,
                const uint8_t* w, const float* s, void* y, int M, int N, int K, long ldx, long ldy, float post,
                const uint8_t* pf, long pf_bytes) {
#define BANYAN_GEMV(KW_, U_)                                                                                  \
  if (kw == KW_ && unroll == U_) {                                                                           \
    if (ahead > 0)                                                                                           \
      return launch(gemv_kernel<FP8, BF16, NT, KW_, U_, true, SILU>, grid, 32 * KW_, st, pdl, x, w, s, y, M, N, \
                    K, ldx, ldy, post, ahead, pf, pf_bytes);                                                 \
    return launch(gemv_kernel<FP8, BF16, NT, KW_, U_, false, SILU>, grid, 32 * KW_, st, pdl, x, w, s, y, M, N,  \
                  K, ldx, ldy, post, 0, pf, pf_bytes);                                                       \
  }
  BANYAN_GEMV(8, 2) BANYAN_GEMV(8, 4) BANYAN_GEMV(16, 2) BANYAN_GEMV(16, 4)
#undef BANYAN_GEMV
  return -1;
}

}  // namespace

// -> 0, or -1 for a configuration not built here (M > 8, the other activation type: one library per type, built
// with BANYAN_GEMV_BF16 = 1 or 0, so that a start-up compiles only what its model runs), or a CUDA error code.
#ifndef BANYAN_GEMV_BF16
#define BANYAN_GEMV_BF16 1
#endif
extern "C" int banyan_gemv(const void* x, const void* w, const float* scale, void* y, int M, int N, int K, long ldx,
                           long ldy, int w_fp8, int act_bf16, int kw, int unroll, int ahead, int pdl, int silu,
                           const void* pf, long pf_bytes, void* stream) {
  constexpr bool BF16 = BANYAN_GEMV_BF16 != 0;
  if (M < 1 || M > (silu ? 2 : 8) || N < 1 || K % (w_fp8 ? 64 : 32) != 0 || (act_bf16 != 0) != BF16 ||
      pf_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(pf) % 16 != 0)
    return -1;
  const dim3 grid((N + 15) / 16);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  // the power of two the widened e4m3 weights (and the x scaled up for bf16) carry, folded back
  const float post = !w_fp8 ? 1.f : BF16 ? 72057594037927936.f /* 2^56 */ : 256.f /* 2^8 */;
  const bool p = pdl != 0;
  int rc;
#define BANYAN_LAUNCH(FP8_, SILU_) \
  launch_kw_u<FP8_, BF16, 1, SILU_>(kw, unroll, ahead, p, grid, st, x, wp, scale, y, M, N, K, ldx, ldy, post, \
                                    static_cast<const uint8_t*>(pf), pf ? pf_bytes : 0)
  if (silu)  // (K is the weight's: x holds 2K per row)
    rc = w_fp8 ? BANYAN_LAUNCH(true, true) : BANYAN_LAUNCH(false, true);
  else
    rc = w_fp8 ? BANYAN_LAUNCH(true, false) : BANYAN_LAUNCH(false, false);
#undef BANYAN_LAUNCH
  if (rc != 0) return rc;
  return static_cast<int>(cudaGetLastError());
}
