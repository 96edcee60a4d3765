"""fp4moe.explain: the planner's verdict as a dict (no GPU needed: an arch from the table)."""
from __future__ import annotations

import pytest

import fp4moe


def test_cutlass_sm120_tile_as_compiled():
    # CUTLASS 4.2's sm_120 NVFP4 grouped GEMM with TensorRT-LLM's default epilogue: the 128x256x128 tile
    # takes 3 auto stages and 98,304 B, 3,072 B under the limit (docs/cutlass-sm120-stages.md; the CPU
    # test compiles the real types). Four stages overflow.
    r = fp4moe.explain("128x256x128", arch="sm_120", kernel="cutlass-sm120-nvfp4-grouped")
    assert r["arch"]["name"] == "sm_120"
    (plan,) = r["plans"]
    assert plan["tile"] == "128x256x128"
    assert r["verdict"]["valid"] and plan["verdict"]["valid"], plan["verdict"]
    assert plan["auto_stages"] == 3 and plan["footprint_bytes"] == 98304, plan
    assert plan["footprint_bytes"] == plan["capacity_bytes"] + plan["over_by_bytes"]
    four = fp4moe.explain("128x256x128", arch="sm_120", kernel="cutlass-sm120-nvfp4-grouped", stages=4)
    assert not four["verdict"]["valid"] and four["plans"][0]["over_by_bytes"] > 0
    assert "StageCount<3>" in four["plans"][0]["fix"], four["plans"][0]["fix"]


def test_sm80_tile_with_a_model_problem():
    r = fp4moe.explain("128x64x128", arch="sm_90", model="glm-5", tokens=1024)
    assert r["verdict"]["valid"], r["verdict"]
    assert r["config"]["bn"] == 128 and r["config"]["bt"] == 64
    assert r["smem"]["total_bytes"] == sum(x["bytes"] for x in r["smem"]["lines"]) or r["smem"]["lines"]
    assert r["occupancy"]["ctas_per_sm"] >= 1
    g1, g2 = r["problem"]["gemms"]
    assert (g1["n"], g1["k"], g2["n"], g2["k"]) == (4096, 6144, 6144, 2048)
    assert r["problem"]["rows_per_expert"] == pytest.approx(1024 * 8 / 256)


def test_sm80_tile_that_does_not_fit():
    r = fp4moe.explain("256x128x256", arch="sm_90", stages=8)
    assert not r["verdict"]["valid"]
    assert r["verdict"]["reason"]


def test_every_config_and_the_pick():
    r = fp4moe.explain(arch="sm_90", model="qwen3-30b", tokens=8)
    assert r["valid_configs"] == sum(c["verdict"]["valid"] for c in r["configs"]) > 0
    assert [p["gemm"] for p in r["picks"]] == [1, 2]
    assert all(p["source"] and p["config"]["name"] for p in r["picks"])


def test_explain_errors():
    with pytest.raises(ValueError, match="kernel"):
        fp4moe.explain(kernel="cublas")
    with pytest.raises(ValueError, match="tile = '128x64'"):
        fp4moe.explain("128x64", arch="sm_90")
    with pytest.raises(fp4moe.Error, match="sm_99"):
        fp4moe.explain("128x64x128", arch="sm_99")
