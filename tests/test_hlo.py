"""Reading collectives, loop trip counts and kernel calls from HLO text in the forms XLA:TPU prints."""

from __future__ import annotations

import pytest

from jaxgpt.tools import hlo

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
