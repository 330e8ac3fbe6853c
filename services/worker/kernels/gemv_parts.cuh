// The device-side parts of gemv.cu's kernels (and norm.cu's 16-bit conversions): the integer widening of e4m3
// bytes, the streaming and x loads, the tensor-core product, SiLU, the rounding the PyTorch reference does, and a
// warp's products over a chunk of steps (``products``).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace banyan {

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

template <bool BF16>
__device__ __forceinline__ float to_f(uint16_t v) {
  if (BF16) return __bfloat162float(__ushort_as_bfloat16(v));
  return __half2float(__ushort_as_half(v));
}

template <bool BF16>
__device__ __forceinline__ uint16_t from_f(float v) {  // round to nearest even, as torch does
  if (BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return __half_as_ushort(__float2half_rn(v));
}

// U steps of weight loads (16 bytes a lane from each of its two rows) from step s0.
template <bool FP8, int U>
__device__ __forceinline__ void load_w(uint4 (&va)[U], uint4 (&vb)[U], const uint8_t* wa, const uint8_t* wb, int s0) {
  constexpr int STEP = FP8 ? 64 : 32;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long off = (long)(s0 + u) * STEP * (FP8 ? 1 : 2);
    va[u] = load_stream(wa + off);
    vb[u] = load_stream(wb + off);
  }
}

// The products of U steps of one warp from step s0, the weights already loaded (va, vb): the x loads first (16
// bytes each), then the tensor-core products.
// SILU (M <= 2, NT = 1): x is [gate | up] (M, 2K); the activation of the step's M x STEP values is spread over
// the warp (lane p makes the pair at k 2p: 32 pairs a row for e4m3, 16 for T) and handed to the lanes that
// multiply it by shuffles — 2 exponentials a lane and row, where each consumer lane making its own 16 would
// keep the warp's special-function unit busy longer than its loads.
template <bool FP8, bool BF16, int NT, int U, bool SILU>
__device__ __forceinline__ void products(float (&acc)[NT][4], const uint4 (&va)[U], const uint4 (&vb)[U],
                                         const uint16_t* const (&xr)[NT], const bool (&xin)[NT], int s0,
                                         const uint16_t* xs, long ldx, int M, int K) {
  constexpr int E = FP8 ? 16 : 8;  // weight elements a lane reads per row and step (16 bytes)
  constexpr int STEP = 4 * E;      // k per step (a warp: 16 rows x STEP k)
  constexpr int XV = FP8 ? 2 : 1;  // 16-byte vectors of x a lane reads per step
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // x scaled by 2^64 when e4m3 weights are widened as bf16 x 2^-120 (products stay far from subnormals)
  const __nv_bfloat162 x_up = __floats2bfloat162_rn(18446744073709551616.f, 18446744073709551616.f);
  uint4 vx[NT][U][XV];
  uint32_t gate[SILU ? U : 1][2], up[SILU ? U : 1][2];
  const int lane = threadIdx.x & 31;
  const int pk = 2 * (FP8 ? lane : (lane & 15));  // (SILU) the pair this lane makes, its k in the step
#pragma unroll
  for (int u = 0; u < U; ++u) {
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
        for (int h = 0; h < XV; ++h) {
          const long k = (long)(s0 + u) * STEP + h * 8;
          vx[n][u][h] = xin[n] ? load_x(xr[n] + k) : zero;
        }
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

}  // namespace banyan
