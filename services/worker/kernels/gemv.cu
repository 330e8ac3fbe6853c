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
// loads; a launch that overlaps the kernel before (PDL); silu(gate) * up made in the kernel (M <= 2); the
// pipelined kernel (gemv_pipe_kernel: the first weight chunk loaded before waiting for the kernel before, each
// next chunk before the products of this one).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemv_parts.cuh"
#include "pdl.cuh"

namespace {
using namespace banyan;

// U steps of one warp from step s0: the loads of all U first (16 bytes each), then the products.
template <bool FP8, bool BF16, int NT, int U, bool SILU>
__device__ __forceinline__ void run_steps(float (&acc)[NT][4], const uint8_t* wa, const uint8_t* wb,
                                          const uint16_t* const (&xr)[NT], const bool (&xin)[NT], int s0,
                                          const uint16_t* xs, long ldx, int M, int K) {
  uint4 va[U], vb[U];
  load_w<FP8, U>(va, vb, wa, wb, s0);
  products<FP8, BF16, NT, U, SILU>(acc, va, vb, xr, xin, s0, xs, ldx, M, K);
}

// The block's warps' partial sums added in a fixed order (the same sum every run), times ``post`` and the row's
// scale, stored in T: warp 0 of the block stores its 16 rows x M columns. ``act``: the block's rows are 8 gate
// rows (g) and the matching 8 up rows (g + 8, N / 2 further: tile_rows): each lane has both of a pair and stores
// silu(gate) * up (each rounded to T first, as the projection's output is; the product in float32, rounded once,
// as SiluAndMul does) at column j of y (M, N / 2).
template <bool BF16, int NT, int KW>
__device__ __forceinline__ void store_sums(const float (&acc)[NT][4], const float* scale, void* y, int M, int N,
                                           long ldy, float post, bool act) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  __shared__ float part[KW][NT][4][32];
#pragma unroll
  for (int n = 0; n < NT; ++n)
    for (int i = 0; i < 4; ++i) part[warp][n][i][lane] = acc[n][i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = part[0][n][i][lane];
#pragma unroll
      for (int q = 1; q < KW; ++q) v[i] += part[q][n][i][lane];  // (in order: the same sum every run)
      v[i] *= post;
    }
    if (act) {
      const int j = blockIdx.x * 8 + g;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = n * 8 + 2 * t + c;
        if (j < N / 2 && m < M) {
          const float gate = to_f<BF16>(from_f<BF16>(scale != nullptr ? v[c] * scale[j] : v[c]));
          const float up = to_f<BF16>(from_f<BF16>(scale != nullptr ? v[c + 2] * scale[N / 2 + j] : v[c + 2]));
          const uint16_t a = from_f<BF16>(gate / (1.f + expf(-gate)) * up);
          static_cast<uint16_t*>(y)[(long)m * ldy + j] = a;
        }
      }
      continue;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + (i >= 2 ? 8 : 0);
      const int m = n * 8 + 2 * t + (i & 1);
      if (row < N && m < M) {
        float r = v[i];
        if (scale != nullptr) r *= scale[row];
        static_cast<uint16_t*>(y)[(long)m * ldy + row] = from_f<BF16>(r);
      }
    }
  }
}

// The weight rows lane row g of a block reads as its A rows g and g + 8: the tile's 16 rows, or with ``act`` gate
// row j = 8 * block + g and up row N / 2 + j (rows past the end read the last one: their sums are never stored).
__device__ __forceinline__ void tile_rows(bool act, int N, int g, int& ra, int& rb) {
  if (act) {
    ra = min((int)blockIdx.x * 8 + g, N / 2 - 1);
    rb = N / 2 + ra;
  } else {
    ra = min((int)blockIdx.x * 16 + g, N - 1);
    rb = min((int)blockIdx.x * 16 + g + 8, N - 1);
  }
}

// The warp's share of the block's work: its steps [s_lo, s_hi) of K (the block's warps split K evenly) and where
// its lane's two weight rows start (tile_rows), at the lane's 16 bytes of a step.
struct WarpPart {
  int s_lo, s_hi;
  const uint8_t* wa;
  const uint8_t* wb;
};

template <bool FP8, int KW>
__device__ __forceinline__ WarpPart warp_part(const uint8_t* w, int N, int K, bool act) {
  constexpr int STEP = FP8 ? 64 : 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int steps = K / STEP;
  const int per_warp = (steps + KW - 1) / KW;
  WarpPart p;
  p.s_lo = min(steps, warp * per_warp);
  p.s_hi = min(steps, p.s_lo + per_warp);
  const long wrow = (long)K * (FP8 ? 1 : 2);
  int ra, rb;
  tile_rows(act, N, lane >> 2, ra, rb);
  p.wa = w + ra * wrow + (lane & 3) * 16;
  p.wb = w + rb * wrow + (lane & 3) * 16;
  return p;
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
                                                       int act, int ahead) {
  constexpr int E = FP8 ? 16 : 8;
  constexpr int STEP = 4 * E;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const WarpPart p = warp_part<FP8, KW>(w, N, K, act != 0);
  const int s_lo = p.s_lo, s_hi = p.s_hi;
  const uint8_t* wa = p.wa;
  const uint8_t* wb = p.wb;
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
  store_sums<BF16, NT, KW>(acc, scale, y, M, N, ldy, post, act != 0);
}

// (blocks an SM must hold: registers capped so that 768-1024 threads fit, as the plain kernel's do — the two
// chunks in flight must not cost resident warps; 4-warp blocks: more, smaller blocks, a finer last wave)
#define PIPE_BLOCKS(KW) ((KW) == 4 ? 6 : (KW) == 8 ? 3 : 2)

// The pipelined kernel (M <= 8, one column tile): each warp's first chunk of U steps loaded before the wait for
// the kernel before it (a weight is no kernel's output: with PDL those loads overlap that kernel's end), then
// each next chunk loaded before the products of the one in hand — two chunks a warp in flight.
template <bool FP8, bool BF16, int KW, int U, bool SILU>
__global__ void __launch_bounds__(32 * KW, PIPE_BLOCKS(KW)) gemv_pipe_kernel(const void* __restrict__ x, const uint8_t* __restrict__ w,
                                                            const float* __restrict__ scale, void* __restrict__ y,
                                                            int M, int N, int K, long ldx, long ldy, float post,
                                                            int act) {
  constexpr int E = FP8 ? 16 : 8;
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const WarpPart p = warp_part<FP8, KW>(w, N, K, act != 0);
  const uint16_t* xs = static_cast<const uint16_t*>(x);
  const bool xin[1] = {g < M};
  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
  uint4 va[U], vb[U];
  int s0 = p.s_lo;
  if (s0 + U <= p.s_hi) load_w<FP8, U>(va, vb, p.wa, p.wb, s0);
  wait_for_previous_kernel();
  const uint16_t* xr[1] = {xs + (long)g * ldx + t * E};
  for (; s0 + U <= p.s_hi; s0 += U) {
    uint4 na[U], nb[U];
    const bool more = s0 + 2 * U <= p.s_hi;
    if (more) load_w<FP8, U>(na, nb, p.wa, p.wb, s0 + U);
    products<FP8, BF16, 1, U, SILU>(acc, va, vb, xr, xin, s0, xs, ldx, M, K);
    if (more) {
#pragma unroll
      for (int u = 0; u < U; ++u) { va[u] = na[u]; vb[u] = nb[u]; }
    }
  }
  for (; s0 < p.s_hi; ++s0) {
    uint4 a1[1], b1[1];
    load_w<FP8, 1>(a1, b1, p.wa, p.wb, s0);
    products<FP8, BF16, 1, 1, SILU>(acc, a1, b1, xr, xin, s0, xs, ldx, M, K);
  }
  let_next_kernel_start();
  store_sums<BF16, 1, KW>(acc, scale, y, M, N, ldy, post, act != 0);
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

// One launch of the kernel the arguments pick: (kw, unroll) among the pairs built here; ``pipe`` the pipelined
// kernel, else ``ahead`` > 0 the prefetching one. The pipelined kernel is built for 2 steps a chunk only (two
// chunks in flight: with 4, the register cap spills), with 4, 8 or 16 warps.
template <bool FP8, bool BF16, bool SILU>
int launch_kw_u(int kw, int unroll, int ahead, bool pdl, bool pipe, dim3 grid, cudaStream_t st, const void* x,
                const uint8_t* w, const float* s, void* y, int M, int N, int K, long ldx, long ldy, float post,
                int act) {
  if (pipe) {
    if (kw == 8 && unroll == 2)
      return launch(gemv_pipe_kernel<FP8, BF16, 8, 2, SILU>, grid, 256, st, pdl, x, w, s, y, M, N, K, ldx, ldy,
                    post, act);
    if (kw == 4 && unroll == 2)
      return launch(gemv_pipe_kernel<FP8, BF16, 4, 2, SILU>, grid, 128, st, pdl, x, w, s, y, M, N, K, ldx, ldy,
                    post, act);
    if (kw == 16 && unroll == 2)
      return launch(gemv_pipe_kernel<FP8, BF16, 16, 2, SILU>, grid, 512, st, pdl, x, w, s, y, M, N, K, ldx, ldy,
                    post, act);
    return -1;
  }
#define BANYAN_GEMV(KW_, U_)                                                                                    \
  if (kw == KW_ && unroll == U_) {                                                                             \
    if (ahead > 0)                                                                                             \
      return launch(gemv_kernel<FP8, BF16, 1, KW_, U_, true, SILU>, grid, 32 * KW_, st, pdl, x, w, s, y, M, N, K, \
                    ldx, ldy, post, act, ahead);                                                               \
    return launch(gemv_kernel<FP8, BF16, 1, KW_, U_, false, SILU>, grid, 32 * KW_, st, pdl, x, w, s, y, M, N, K,  \
                  ldx, ldy, post, act, 0);                                                                     \
  }
  BANYAN_GEMV(8, 2) BANYAN_GEMV(8, 4) BANYAN_GEMV(16, 2) BANYAN_GEMV(16, 4)
#undef BANYAN_GEMV
  return -1;
}

}  // namespace

// -> 0, or -1 for a configuration not built here (M > 8, the other activation type: one library per type, built
// with BANYAN_GEMV_BF16 = 1 or 0, so that a start-up compiles only what its model runs), or a CUDA error code.
// ``act``: W is [gate | up]
// (N = 2I rows, N a multiple of 16) and y (M, I) gets silu(x gate^T) * (x up^T) (store_sums).
#ifndef BANYAN_GEMV_BF16
#define BANYAN_GEMV_BF16 1
#endif
extern "C" int banyan_gemv(const void* x, const void* w, const float* scale, void* y, int M, int N, int K, long ldx,
                           long ldy, int w_fp8, int act_bf16, int kw, int unroll, int ahead, int pdl, int silu,
                           int pipe, int act, void* stream) {
  constexpr bool BF16 = BANYAN_GEMV_BF16 != 0;
  if (M < 1 || M > (silu ? 2 : 8) || N < 1 || K % (w_fp8 ? 64 : 32) != 0 || (act_bf16 != 0) != BF16 ||
      (act && (N % 16 != 0 || silu)))
    return -1;
  const dim3 grid(act ? N / 16 : (N + 15) / 16);  // (act: 8 gate and 8 up rows a block, N / 2 apart)
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  // the power of two the widened e4m3 weights (and the x scaled up for bf16) carry, folded back
  const float post = !w_fp8 ? 1.f : BF16 ? 72057594037927936.f /* 2^56 */ : 256.f /* 2^8 */;
  const bool p = pdl != 0, q = pipe != 0;
  int rc;
#define BANYAN_LAUNCH(FP8_, SILU_) \
  launch_kw_u<FP8_, BF16, SILU_>(kw, unroll, ahead, p, q, grid, st, x, wp, scale, y, M, N, K, ldx, ldy, post, act)
  if (silu)  // (K is the weight's: x holds 2K per row)
    rc = w_fp8 ? BANYAN_LAUNCH(true, true) : BANYAN_LAUNCH(false, true);
  else
    rc = w_fp8 ? BANYAN_LAUNCH(true, false) : BANYAN_LAUNCH(false, false);
#undef BANYAN_LAUNCH
  if (rc != 0) return rc;
  return static_cast<int>(cudaGetLastError());
}
