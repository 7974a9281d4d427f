"""Helpers of the benchmark scripts that decide what their tables say, on CPU: the phases of a whole-step graph
generate() call (bench.py), the exposed time of overlapping kernels (profile_decode.py), the GPU's idle gaps of a
training step put down to the host (profile_train.py), the launch rules a variant of decode_variants.py sets, the
step without Liger's synchronizations (liger_syncs.py), the passes of bench.py's rows, the model of a launch's
programs in launch_order.py and attention_bench.py's kernels of a layer's step."""

import argparse
import os
import sys

import pytest
import torch

from conftest import tiny_model
from modeling_diff import generation
from modeling_diff.generation import graphed_greedy_generate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import attention_bench  # noqa: E402
import bench  # noqa: E402
import decode_variants  # noqa: E402
import launch_order  # noqa: E402
import liger_syncs  # noqa: E402
import profile_decode  # noqa: E402
import profile_train  # noqa: E402

STATIC = dict(cache_implementation="static", do_sample=False)


def test_the_benchmarks_phase_timing_splits_a_call_and_restores_the_methods(monkeypatch):
    """benchmarks/bench.py's `graph_phases_timed` (the generate rows' `phases_ms`): a whole-step graph call's prompt
    and steps get their wall times, the tokens stay those of the plain call, and the methods it wrapped are the
    class's own again afterwards."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)  # CPU: the eager steps (capture=False)
    model = tiny_model("dex", attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    methods = (generation.GreedyStepGraph.prefill, generation.GreedyStepGraph.run)
    expected = graphed_greedy_generate(model, ids, None, dict(max_new_tokens=5, **STATIC), capture=False)
    with bench.graph_phases_timed() as phases:
        got = graphed_greedy_generate(model, ids, None, dict(max_new_tokens=5, **STATIC), capture=False)
    assert torch.equal(got, expected)
    assert set(phases) == {"prefill_ms", "steps_ms"} and min(phases.values()) > 0
    assert (generation.GreedyStepGraph.prefill, generation.GreedyStepGraph.run) == methods


@pytest.mark.parametrize("launches, exposed, idle", [
    ([("a", 0, 10), ("b", 12, 20)], {"a": 10, "b": 8}, 2),  # one after the other, 2 idle between them
    ([("a", 0, 10), ("b", 4, 15)], {"a": 10, "b": 5}, 0),  # b starts early (PDL) and finishes 5 after a
    ([("a", 0, 10), ("b", 2, 6), ("c", 8, 12)], {"a": 10, "b": 0, "c": 2}, 0),  # b hidden entirely under a
    ([("b", 5, 9), ("a", 0, 3), ("a", 10, 11)], {"a": 4, "b": 4}, 3),  # out of order; a name's times add up
])
def test_exposed_times_add_up_to_the_span_of_the_kernels(launches, exposed, idle):
    """Each kernel's time on the critical path: after everything that started before it ended; with the idle time
    they make up the span from the first start to the last end."""
    got, got_idle = profile_decode.exposed_times(launches)
    assert got == exposed and got_idle == idle
    span = max(end for _, _, end in launches) - min(start for _, start, _ in launches)
    assert sum(got.values()) + got_idle == span


def test_sync_sites_count_the_synchronizing_calls_by_call_site(monkeypatch):
    """`--syncs`: each warning of torch's sync debug mode is counted at the Python frames that made the call, innermost
    first; other warnings are not counted, and the debug mode is set back after the step."""
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def item():  # where torch would warn: the call that waits for the GPU
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    def step():
        for _ in range(2):
            item()
        warnings.warn("something else", UserWarning)

    sites = profile_train.sync_sites(step, frames=2)
    assert modes == ["warn", 0]
    [(site, count)] = sites.items()
    line = item.__code__.co_firstlineno + 1
    assert count == 2 and site.startswith(f"tests/test_benchmarks.py:{line} < tests/test_benchmarks.py:")


def test_liger_syncs_variant_leaves_out_the_waits_and_puts_liger_back():
    """liger_syncs.py's timed variant: Liger's forward with the count of targets in place of `.item()` of the mask's
    sum and its backward without `torch.equal` (the three waits) while the block runs, Liger's own after it."""
    module = pytest.importorskip("liger_kernel.ops.fused_linear_cross_entropy")
    forward, backward = module.fused_linear_cross_entropy_forward, module.fused_linear_cross_entropy_backward
    assert "item" in forward.__code__.co_names and "equal" in backward.__code__.co_names
    with liger_syncs.without_syncs():
        assert module.fused_linear_cross_entropy_forward is not forward
        assert "numel" in module.fused_linear_cross_entropy_forward.__code__.co_names  # the count's stand-in
        assert "equal" not in module.fused_linear_cross_entropy_backward.__code__.co_names
    assert module.fused_linear_cross_entropy_forward is forward
    assert module.fused_linear_cross_entropy_backward is backward


def test_idle_gaps_are_put_down_to_the_host_operators_around_the_late_launch(tmp_path):
    """Two gaps: kernel b launched 30 us after a ended, inside the step > backward > our node on thread 2 (the host
    was behind); kernel c launched before b ended, so the 5 us before it are launch latency, not the host's. And the
    trace file as torch.profiler writes it gives the same."""
    kernels = [(0, 10, 1), (50, 60, 2), (65, 70, 3)]
    launches = {1: (-5, 1), 2: (40, 2), 3: (45, 2)}
    host_ops = [(-10, 100, 1, "step"), (20, 90, 2, "autograd::engine: Backward"), (35, 42, 2, "combine.py: backward"),
                (41, 43, 1, "elsewhere")]  # another thread's op around 40: not the launching thread's
    total, gaps = profile_train.idle_gaps(kernels, launches, host_ops, min_gap=1)
    assert total == 40 + 5
    assert gaps == [(40, 30, ["autograd::engine: Backward", "combine.py: backward"]),
                    (5, -15, ["autograd::engine: Backward"])]
    assert profile_train.idle_gaps(kernels, launches, host_ops, min_gap=10) == (45, gaps[:1])

    import gzip
    import json
    events = [dict(ph="X", cat="kernel", ts=s, dur=e - s, tid=7, args=dict(correlation=c)) for s, e, c in kernels]
    events += [dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=t, dur=1, tid=th, args=dict(correlation=c))
               for c, (t, th) in launches.items()]
    events += [dict(ph="X", cat="python_function" if n.endswith("backward") else "cpu_op", name=n, ts=s, dur=e - s,
                    tid=th) for s, e, th, n in host_ops]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=events + [dict(ph="f", cat="ac2g", ts=0, id=1)]), f)
    assert profile_train.idle_gaps(*profile_train.trace_events(str(path)), min_gap=1) == (total, gaps)
    report = profile_train.gap_report(str(path), min_gap=1)
    assert "GPU idle within the step: 0.04 ms" in report and "combine.py: backward" in report


def test_kernel_gaps_sum_small_and_large_idle_stretches_and_name_the_kernels_around_the_large():
    """Kernels a [0, 10], b [12, 20] (2 us: small), c [50, 60] launched while b ran dry (30 us: large), d [55, 58]
    inside c (no gap), e [61, 62]."""
    kernels = [(50, 60, "c"), (0, 10, "a"), (12, 20, "b"), (55, 58, "d"), (61, 62, "e")]
    report = profile_train.kernel_gaps(kernels, large=20)
    assert "0.03 ms; 0.00 ms in gaps of < 20 us, 0.03 ms in 1 of >= 20 us; 5 kernels" in report
    assert report.splitlines()[-1].split() == ["30.0", "b", "->", "c"]


def test_launch_sites_count_a_step_s_kernels_and_memsets_by_the_named_host_operator_that_launched_them():
    """Two memsets and a kernel from our combine's backward (a Python frame inside autograd's engine), one kernel from
    Liger's frame inside an aten op (the named frame, not the innermost op, takes it), one without a launch event."""
    kernels = [(0, 2, 1, "Memset (Device)"), (3, 4, 2, "Memset (Device)"), (5, 9, 3, "_combine_bwd"),
               (10, 20, 4, "liger_cross_entropy_kernel"), (21, 22, 5, "Memcpy DtoD (Device -> Device)")]
    launches = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (8, 1)}
    host_ops = [(0, 4, 1, "autograd::engine: Backward"), (0.5, 3.5, 1, "modeling_diff/kernels/combine.py(9): backward"),
                (7, 9, 1, "liger_kernel/ops/cross_entropy.py(3): forward"), (7.5, 8.5, 1, "aten::empty")]
    sites = profile_train.launch_sites(kernels, launches, host_ops)
    assert sites[("modeling_diff/kernels/combine.py(9): backward", "memset", "count")] == 2
    assert sites[("modeling_diff/kernels/combine.py(9): backward", "memset", "us")] == 3
    assert sites[("modeling_diff/kernels/combine.py(9): backward", "kernel", "count")] == 1
    assert sites[("liger_kernel/ops/cross_entropy.py(3): forward", "kernel", "us")] == 10
    assert sites[("(no launch)", "memcpy", "count")] == 1


def test_matmul_table_gives_each_product_s_tflops_and_time_above_the_peak():
    """FLOPs as 2 x batch x M x K x N, written out here, for mm, addmm (the factors after the sum) and baddbmm; an
    operator that is not a product and one that ran no GPU time are left out."""
    from types import SimpleNamespace as Event

    events = [Event(key="aten::mm", input_shapes=[[8, 4], [4, 16]], count=2, device_time_total=1.0),
              Event(key="aten::addmm", input_shapes=[[16], [8, 4], [4, 16], [], []], count=1, device_time_total=2.0),
              Event(key="aten::baddbmm", input_shapes=[[3, 8, 16], [3, 8, 4], [3, 4, 16], [], []], count=1,
                    device_time_total=5.0),
              Event(key="aten::add", input_shapes=[[8], [8]], count=1, device_time_total=1.0),
              Event(key="aten::bmm", input_shapes=[[3, 8, 4], [3, 4, 16]], count=1, device_time_total=0.0)]
    peak = 2 * 8 * 4 * 16 / 1e-6  # FLOP/s at which one (8 x 4) @ (4 x 16) takes 1 us
    rows = profile_train.matmul_table(events, peak)
    assert [r["op"] for r in rows] == ["baddbmm", "addmm", "mm"]  # most time above the peak first
    by_op = {r["op"]: r for r in rows}
    assert by_op["mm"]["tflops"] == pytest.approx(2 * 2 * 8 * 4 * 16 / 1e-6 / 1e12)
    assert by_op["mm"]["lost_ms"] == pytest.approx(-1e-3)  # two products in 1 us: twice the peak
    assert by_op["addmm"]["lost_ms"] == pytest.approx(1e-3)
    assert by_op["baddbmm"]["lost_ms"] == pytest.approx(2e-3)  # 3 products in 5 us
    assert by_op["addmm"]["shapes"] == "(16,) x (8, 4) x (4, 16)"


@pytest.mark.parametrize("name, expected", [
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_", "attention forward"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at", "attention backward"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPostpro", "attention backward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1", "attention forward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1", "attention backward"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*", "attention backward"),
    ("_flash_diff_fwd", "attention forward"),
    ("_flash_diff_bwd_dkdv", "attention backward"),
    ("_flash_diff_bwd_dq", "attention backward"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention forward"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention backward"),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention backward"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "matmul"),
    ("_swiglu_bwd", "other"),
])
def test_kernel_classes_put_flash_attention_4_s_cutlass_kernels_with_attention(name, expected):
    """Kernel names as torch.profiler reported them on an H100 (FlashAttention-4's CuTe kernels carry "cutlass" in
    their names, cuDNN's backward says "bprop")."""
    assert profile_train.kernel_class(name) == expected


def test_a_constants_variant_sets_the_launch_rules_and_puts_them_back():
    """`--constants`: each MODULE.NAME=VALUE is set while the variant runs and restored after; a name that is not a
    kernels module's upper-case constant, a value that is not a literal or not of the constant's type, is refused
    with the field named."""
    from modeling_diff.kernels import _triton, projection

    before = (projection.SPLIT_MAX_TOKENS, _triton.PDL_MAX_TOKENS, projection.GATED_FEW_TOKENS)
    variant = decode_variants.constants_variant(
        "projection.SPLIT_MAX_TOKENS=32+_triton.PDL_MAX_TOKENS=32+projection.GATED_FEW_TOKENS=(64,128,4,4)")
    with decode_variants.switched(variant):
        assert (projection.SPLIT_MAX_TOKENS, _triton.PDL_MAX_TOKENS) == (32, 32)
        assert projection.GATED_FEW_TOKENS == (64, 128, 4, 4)
    assert (projection.SPLIT_MAX_TOKENS, _triton.PDL_MAX_TOKENS, projection.GATED_FEW_TOKENS) == before
    for bad, field in (("torch.SPLIT_MAX_TOKENS=32", "torch.SPLIT_MAX_TOKENS"),
                       ("projection.split_linear=1", "projection.split_linear"),
                       ("projection.SPLIT_MAX_TOKENS=thirty", "thirty"),
                       ("projection.SPLIT_MAX_TOKENS=32.0", "of type int")):
        with pytest.raises(SystemExit, match=field):
            decode_variants.constants_variant(bad)


def test_a_pdl_variant_launches_its_kernels_with_pdl_at_any_tokens_and_puts_them_back(monkeypatch):
    """`--pdl-more-tokens`: the named kernels' modules decide PDL as for one token while the variant runs (the
    others as before), and their own `dependent_launch` is back after; an unknown kernel group is refused by name."""
    from modeling_diff.kernels import _triton, projection, rmsnorm, rope, triton_decode

    def by_tokens(tensor, tokens, most=None):  # the rule as on a GPU with PDL (the CPU has none)
        return tokens <= (_triton.PDL_MAX_TOKENS if most is None else most)

    for module in (_triton, projection, rmsnorm, rope, triton_decode):
        monkeypatch.setattr(module, "dependent_launch", by_tokens)
    x = torch.zeros(1)
    variant = decode_variants.pdl_variant("decode+norm")
    decode = _triton.DECODE_PDL_MAX_TOKENS
    with decode_variants.switched(variant):
        assert triton_decode.dependent_launch(x, 32, decode) and rmsnorm.dependent_launch(x, 64)
        assert rope.dependent_launch(x, 64)
        assert not projection.dependent_launch(x, 64) and projection.dependent_launch(x, 32)
    assert not triton_decode.dependent_launch(x, 32, decode) and not rmsnorm.dependent_launch(x, 64)
    with pytest.raises(SystemExit, match="attention"):
        decode_variants.pdl_variant("decode+attention")


def test_passes_merge_into_medians_with_ratios_paired_within_a_pass():
    """`--passes`: each row's median tok/s over the passes and its range, the highest peak, and the training
    table's ratio to llama-liger as the median of each pass's own ratio, the general table (no Llama row in the
    run) the rows' own numbers; a row that failed in a pass keeps its error; one pass is left as it is."""
    def row(model, tok_s, peak=10.0):
        return dict(seq=2048, model=model, phase="train", batch=4, tok_s=tok_s, peak_gib=peak, work=1e9)

    passes = [[row("llama-liger", 100.0), row("v1-liger", 99.0)],
              [row("v1-liger", 90.0, peak=11.0), row("llama-liger", 80.0)],  # a slow pass for both
              [row("llama-liger", 102.0), row("v1-liger", 100.0)]]
    merged = bench.merged_passes(passes)
    v1 = next(r for r in merged if r["model"] == "v1-liger")
    assert v1["passes"] == [99.0, 90.0, 100.0] and v1["tok_s"] == 99.0 and v1["peak_gib"] == 11.0
    for r in merged:
        r["mfu"] = 0.5
    ratios = sorted([99.0 / 100.0, 90.0 / 80.0, 100.0 / 102.0])  # median 0.99, where the medians' ratio is 0.99 too
    line = next(line for line in bench.train_table(merged, 1e15).splitlines() if "v1-liger" in line)
    assert f"| {ratios[1]:.2f}x ({ratios[0]:.2f}-{ratios[2]:.2f}) |" in line
    assert "99 (90-100)" in line
    # the general table, which has no Llama row in this run: each row's own tok/s and peak, no ratios
    line = next(line for line in bench.table(merged).splitlines() if "v1-liger" in line)
    assert line == "| 2048 | train | v1-liger | 99 (90-100) | | | | | | | 11.0 |"

    error = dict(seq=2048, model="v1-liger", phase="train", error="OutOfMemoryError: CUDA out of memory")
    assert bench.merged_passes([[row("v1-liger", 99.0)], [error]]) == [error]
    assert bench.merged_passes([passes[0]]) is passes[0]


def test_passes_run_every_model_once_a_pass_in_rotated_order(monkeypatch):
    """`bench.py --passes 3`: the models' processes in the order a, b, c / b, c, a / c, a, b, and one merged row each;
    the matmul peak is the higher of the readings before and after the rows."""
    order = []

    def model_rows(name, phases, args):
        order.append(name)
        return [dict(seq=2048, model=name, phase="train", batch=4, tok_s=100.0 + len(order), peak_gib=1.0, work=1.0)]

    monkeypatch.setattr(bench, "in_fresh_process", lambda fn, *args: fn(*args))
    monkeypatch.setattr(bench, "device_peaks", lambda: (1e15, 0.9e15, 1e12))
    monkeypatch.setattr(bench, "matmul_peak", lambda: (1.1e15, 0.9e15))  # the reading after the rows
    monkeypatch.setattr(bench, "bench_model_all_lengths", model_rows)
    models = ["llama-liger", "v1-liger", "v2-liger"]
    args = argparse.Namespace(models=models, seq=[2048], phases=["train"], passes=3, prefill_chunk=4096,
                              generate_models=[], tokens=8192)
    results, peak, _ = bench.run(args)
    assert peak == 1.1e15  # MFU's denominator: the higher of the two readings
    assert order == models + models[1:] + models[:1] + models[2:] + models[:2]
    assert [r["model"] for r in results] == models
    assert [r["passes"] for r in results] == [[101.0, 106.0, 108.0], [102.0, 104.0, 109.0], [103.0, 105.0, 107.0]]


def test_a_model_whose_process_fails_gets_its_rows_in_the_table(monkeypatch):
    """A model whose process raises (a kernel library that fails to import) is a row of the table with the error,
    with its shape (seq x batch: --tokens // seq), and the other models' rows are there too."""
    def model_rows(name, phases, args):
        if name == "v2-liger":
            raise TypeError("epilogue fn depends on a ContextVar")
        return [dict(seq=2048, model=name, phase="train", batch=4, tok_s=100.0, peak_gib=1.0, mfu=0.5)]

    monkeypatch.setattr(bench, "in_fresh_process", lambda fn, *args: fn(*args))
    monkeypatch.setattr(bench, "device_peaks", lambda: (1e15, 0.9e15, 1e12))
    monkeypatch.setattr(bench, "matmul_peak", lambda: (1e15, 0.9e15))
    monkeypatch.setattr(bench, "bench_model_all_lengths", model_rows)
    args = argparse.Namespace(models=["dex-liger", "v2-liger"], seq=[2048], phases=["train"], passes=1,
                              prefill_chunk=4096, generate_models=[], tokens=8192)
    results, peak, _ = bench.run(args)
    table = bench.train_table(results, peak).splitlines()
    assert table[2] == "| 2048 x 4 | dex-liger | 100 | 0.500 |  | 1.0 |  |"
    assert table[3] == "| 2048 x 4 | v2-liger | TypeError: epilogue fn depends on a ContextVar | | | | |"


def test_bench_refuses_an_attention_it_does_not_time(capsys):
    """`bench.py --attention` takes the two implementations of the differential models' fast paths (sdpa, their
    default on CUDA, and fused_diff); anything else is refused by name before any GPU work."""
    with pytest.raises(SystemExit):
        bench.main(["--phases", "train", "--attention", "eager"])
    assert "--attention" in capsys.readouterr().err


def test_launch_order_model_takes_the_next_program_into_the_first_free_slot():
    """`launch_order.py`: two slots, works 4, 1, 1, 4 in that order end at 6 (the second 4 starts at 2 beside the
    first), longest first at 5; a (rows x blocks) launch starts each row's blocks in turn with the block on the fast
    axis, every row's first block first without; the tiles a causal block walks."""
    assert launch_order.makespan([4, 1, 1, 4], 2) == 6 and launch_order.makespan([4, 4, 1, 1], 2) == 5
    assert launch_order.started_order([3, 1], 2, block_fast=True) == [3, 1, 3, 1]
    assert launch_order.started_order([3, 1], 2, block_fast=False) == [3, 3, 1, 1]
    # 4 queries in blocks of 2 against keys in tiles of 2: the last block sees both key tiles, the first one
    assert launch_order.query_block_works(4, 2, 2) == [2, 1]
    assert launch_order.key_block_works(4, 2, 2, heads=3) == [6, 3]


def test_attention_bench_profile_sums_each_kernels_gpu_time_per_step():
    """`attention_bench.py --profile`: the GPU time of each kernel name over the profiled steps, per step, in ms (the
    profiler's times are in us); the host's operators (no self device time) are left out."""
    from types import SimpleNamespace

    averages = [  # key_averages(): one entry per name, summed over the steps
        SimpleNamespace(key="_flash_diff_fwd", self_device_time_total=800.0),
        SimpleNamespace(key="nvjet_gemm", self_device_time_total=200.0),
        SimpleNamespace(key="aten::mm", self_device_time_total=0.0),
    ]
    times = attention_bench.per_kernel_ms(averages, repeats=2)
    assert times == {"_flash_diff_fwd": pytest.approx(0.4), "nvjet_gemm": pytest.approx(0.1)}


def test_attention_bench_sweep_gives_the_descriptors_each_configs_key_tile():
    """`attention_bench.py --sweep` launches each config of its grid in place of the autotuner, whose pre-hook gives
    the key and value descriptors the config's BLOCK_N rows: the fixed launch must do the same, at every launch and
    relaunch, or the forward and dQ kernels would read tiles of another config's size."""
    from types import SimpleNamespace

    launches = []

    class Kernel:  # a JIT function's launch interface: kernel[grid](*args, **meta)
        arg_names = ["Q", "Kd", "Vd", "H"]

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, [a.block_shape[:] for a in args[1:3]], meta))

    keys, values = SimpleNamespace(block_shape=[1, 64]), SimpleNamespace(block_shape=[1, 128])
    for block_n in (32, 128):
        fixed = attention_bench.FixedLaunch(Kernel(), BLOCK_M=64, BLOCK_N=block_n, num_warps=4, num_stages=3)
        fixed[lambda meta: (8, meta["BLOCK_M"])]("q", keys, values, 2, SCALE=0.125)
        fixed.relaunch()
        for grid, shapes, meta in launches[-2:]:
            assert grid == (8, 64) and shapes == [[block_n, 64], [block_n, 128]]
            assert meta == dict(SCALE=0.125, BLOCK_M=64, BLOCK_N=block_n, num_warps=4, num_stages=3)
