"""bench/profile_step.py's arithmetic on a GPU's kernels, with made-up kernel intervals (the
CPU smoke test in test_gpu_check.py runs the profiler itself): names sorted into matmul /
attention / elementwise / other, overlapping kernels counted once, gaps as idle."""
import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "profile_step", Path(__file__).resolve().parents[2] / "bench" / "profile_step.py")
P = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(P)


@pytest.mark.parametrize("name,kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("triton_tem_fused_mm_3", "matmul"),
    ("aten::mm", "matmul"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
    ("triton_poi_fused_mul_silu_1", "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "elementwise"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
])
def test_kernels_are_sorted_by_name_into_kinds(name, kind):
    assert P.kind(name) == kind


def test_overlapping_kernels_count_once_and_gaps_are_idle():
    events = [("gemm_a", 0.0, 40.0), ("flash_fwd", 30.0, 20.0),  # busy 0..50
              ("triton_poi_fused_add", 60.0, 20.0),  # gap 50..60, busy 60..80
              ("Memcpy DtoD", 90.0, 10.0)]  # gap 80..90, busy 90..100
    out = P.summarize(events, "cuda", window_s=1.0, top=3)
    assert out["window_ms"] == pytest.approx(0.1) and out["busy_ms"] == pytest.approx(0.08)
    shares = out["shares"]
    assert shares["idle"] == pytest.approx(0.2)
    assert sum(shares.values()) == pytest.approx(1.0)
    # kernel time 90 us over 80 us busy: each kind's share of the kernels, scaled to busy
    assert shares["matmul"] == pytest.approx(40 / 90 * 0.8)
    assert shares["attention"] == pytest.approx(20 / 90 * 0.8)
    assert [k["name"] for k in out["top"]] == ["gemm_a", "flash_fwd", "triton_poi_fused_add"]
