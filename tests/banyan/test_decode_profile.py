"""The decode profile's kernel groups (benchmarks/gpu/decode_profile.py; the profile itself needs a
GPU): the names the H200's kernels carry land in the group that does that work."""

from __future__ import annotations

import pytest

from benchmarks.gpu.decode_profile import group_of


@pytest.mark.parametrize("name, group", [
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<(PosEncodingMode)0, 2u>", "attention"),
    ("void flashinfer::MergeStatesKernel<8u, 16u>", "attention"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "norm"),
    ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 128u>", "rope"),
    ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, silu>", "activation"),
    ("_store_kv_kernel", "kv write"),
    ("void at::native::index_copy_kernel_impl<...>", "kv write"),
    ("_linear_kernel", "gemm/gemv"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm/gemv"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4>", "gemm/gemv"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
     "sampling"),
    ("Memcpy HtoD (Pageable -> Device)", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
])
def test_kernel_names_fall_in_their_groups(name, group) -> None:
    assert group_of(name) == group
