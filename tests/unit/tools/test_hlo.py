"""Reading collectives, loop trip counts, kernel calls and host transfers from HLO text in the forms XLA:TPU and
XLA:GPU print."""

from __future__ import annotations

import pytest

from jaxgpt.tools import hlo

pytestmark = pytest.mark.jax_release

# A step shaped like XLA:TPU's output: a scan loop of 4 trips without known_trip_count (its bound is the
# condition's constant), an all-gather over a mesh axis of 2 repeated in an async start/done pair (one
# channel), a fused reduce-scatter and a Pallas kernel inside the loop, an all-reduce in the entry.
HLO = """HloModule jit_train_step, is_scheduled=true

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(4)
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}

%all-reduce-scatter.1.clone (input_0: bf16[256,1024]) -> bf16[128,1024] {
  %input_0 = bf16[256,1024]{1,0} parameter(0)
  %all-reduce.9 = bf16[256,1024]{1,0} all-reduce(%input_0), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %slice = bf16[128,1024]{1,0} slice(%all-reduce.9), slice={[0:128], [0:1024]}
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %w = bf16[64,256]{1,0} get-tuple-element(%p), index=1
  %all-gather.1 = bf16[128,256]{1,0:T(8,128)(2,1)} all-gather(%w), channel_id=7, @MESH_GROUP@, dimensions={0}
  %all-gather.2 = bf16[128,256]{1,0:T(8,128)(2,1)} all-gather(%w), channel_id=7, @MESH_GROUP@, dimensions={0}
  %fusion.3 = bf16[128,1024]{1,0} fusion(%w), kind=kCustom, calls=%all-reduce-scatter.1.clone
  %splash_mha_fwd_residuals.2 = (bf16[4,512,64]{2,1,0}, f32[4,512,128]{2,1,0}) custom-call(%w),
@KERNEL@
  ROOT %t = (s32[]{:T(128)}, f32[8]{0}) tuple(%p)
}

ENTRY %main.1 (a: f32[1000]) -> f32[1000] {
  %a = f32[1000]{0} parameter(0)
  %while.1 = (s32[]{:T(128)}, f32[8]{0}) while(%a), condition=%cond, body=%body
  ROOT %all-reduce.2 = f32[1000]{0} all-reduce(%a), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
}
""".replace("@MESH_GROUP@", "replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_1'}").replace(
    ",\n@KERNEL@", ', custom_call_target="tpu_custom_call"')


def test_loop_trip_counts_come_from_the_condition_bound() -> None:
    runs = hlo.run_counts(HLO)
    assert runs["main.1"] == 1 and runs["body"] == 4 and runs["all-reduce-scatter.1.clone"] == 4


def test_collectives_are_counted_once_per_channel_and_weighted_by_loop_trips() -> None:
    c = hlo.collectives(HLO, n_devices=4)
    gather = 128 * 256 * 2  # the output; a group of 2 (axis_1) sends half of it, 4 times
    assert c["all-gather"]["count"] == 4 and c["all-gather"]["traffic"] == pytest.approx(4 * gather / 2)
    scatter = 256 * 1024 * 2  # the fused reduce-scatter's input, over groups of 2
    assert c["reduce-scatter"]["count"] == 4 and c["reduce-scatter"]["traffic"] == pytest.approx(4 * scatter / 2)
    assert c["all-reduce"]["count"] == 1 and c["all-reduce"]["traffic"] == pytest.approx(2 * 4000 * 3 / 4)


def test_pallas_kernels_are_found_by_name_with_their_runs() -> None:
    (call,) = hlo.custom_calls(HLO)
    assert call["kernel"] == "splash_mha_fwd_residuals" and call["runs"] == 4


# A step shaped like XLA:GPU's output: a GEMM fusion, a cuDNN attention call, an asynchronous all-reduce whose type
# holds its operand and result, a loop of 4 known trips and one whose trips XLA does not know (its bound is a
# parameter), and a copy into host memory (memory space S(5)).
GPU_HLO = """HloModule jit_train_step, is_scheduled=true

%fused_gemm (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add = f32[8]{0} add(%p0, %p0)
}

%cond (p: (s32[], f32[8], s32[])) -> pred[] {
  %p = (s32[], f32[8]{0}, s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=2
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8], s32[])) -> (s32[], f32[8], s32[]) {
  %p = (s32[], f32[8]{0}, s32[]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[8]{0}, s32[]) tuple(%p)
}

ENTRY %main.9 (a: bf16[64,32], b: bf16[32,16], c: f32[8]) -> f32[8] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %c = f32[8]{0} parameter(2)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(3)
  %g = bf16[1000]{0} parameter(4)
  %s = (s32[], f32[8]{0}, s32[]) parameter(5)
  %gemm = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_gemm, @GEMM@
  %attn = (bf16[2,4,128,64]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), @CUDNN@
  %ars = ((bf16[1000]{0}), bf16[1000]{0}) all-reduce-start(%g), channel_id=5, replica_groups=[1,8]<=[8], to_apply=%add
  %ard = bf16[1000]{0} all-reduce-done(%ars)
  %known = (s32[], f32[8]{0}, s32[]) while(%s), condition=%cond, body=%body, @KNOWN@
  %unknown = (s32[], f32[8]{0}, s32[]) while(%s), condition=%cond, body=%body
  ROOT %host = f32[8]{0:S(5)} copy(%c)
}
""".replace("@GEMM@", 'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}').replace(
    "@CUDNN@", 'custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": '
    '{"mask_type": "CAUSAL"}}').replace("@KNOWN@", 'backend_config={"known_trip_count":{"n":"4"}}')


def test_gpu_launches_loops_and_host_transfers() -> None:
    # (the loops' conditions are kernels too: "other")
    assert hlo.launches(GPU_HLO) == {"fusion": 5, "other": 2, "matmul": 1, "cuDNN": 1, "collective": 1, "copy": 1}
    assert [(loop["trips"], loop["known"], loop["body_launches"]) for loop in hlo.loops(GPU_HLO)] == [
        (4, True, 1), (None, False, 1)]
    kinds = [(t["kind"], t["bytes"]) for t in hlo.host_transfers(GPU_HLO)]
    assert kinds == [("loop condition read by the host", 4 + 32 + 4), ("to host memory", 32)]
    reduce = hlo.collectives(GPU_HLO, n_devices=8)["all-reduce"]  # the result's 2000 bytes, not the pair's 4000
    assert reduce["bytes"] == 2000 and reduce["traffic"] == pytest.approx(2 * 2000 * 7 / 8)


def test_cudnn_attention_is_counted_from_its_shapes() -> None:
    from jaxgpt.tools import gpus

    flops, bytes_, calls = gpus.cudnn_attention_cost(GPU_HLO)
    assert calls == 1 and flops == 2 * 2 * 2 * 4 * 128 * 128 * 64 / 2  # two causal products of (B, H, T, T, D)
    assert bytes_ == 4 * 2 * 4 * 128 * 64 * 2 + 2 * 4 * 128 * 4  # q, k, v, out in bf16; float32 row statistics
