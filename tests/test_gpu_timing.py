"""How the GPU suite times the node against plain ComfyUI (tests/gpu/timing.py), with fake timers: the runs alternate,
each side is its median with its range, the ratio is of the medians, and a profiler that fails is said, not raised."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import timing


def fake(name: str, times: list[float], calls: list[str]):
    """A side whose runs take `times` in turn, noting each call in `calls`."""
    it = iter(times)

    def run() -> float:
        calls.append(name)
        return next(it)
    return run


def test_the_sides_alternate_node_first():
    calls: list[str] = []
    node_s, plain_s = timing.interleaved(fake("node", [1, 2, 3], calls), fake("plain", [4, 5, 6], calls), runs=3)
    assert calls == ["node", "plain"] * 3
    assert (node_s, plain_s) == ([1, 2, 3], [4, 5, 6])


def test_median_range_and_ratio_of_the_medians():
    calls: list[str] = []
    # plain's samples are noisy and skewed: its mean (3.0) would give another ratio than its median (2.6)
    node = fake("node", [0.72, 0.70, 0.73, 0.71, 0.72], calls)
    plain = fake("plain", [2.9, 2.6, 4.6, 2.5, 2.4], calls)
    t = timing.measure(node, plain, gpu=False, runs=5)
    assert calls == ["node", "plain"] * 5  # no extra (profiled) run without a GPU
    assert (t.node.median, t.node.low, t.node.high) == (0.72, 0.70, 0.73)
    assert (t.plain.median, t.plain.low, t.plain.high) == (2.6, 2.4, 4.6)
    assert t.plain.samples == (2.9, 2.6, 4.6, 2.5, 2.4)  # as run, for the JSON record
    assert t.ratio == pytest.approx(2.6 / 0.72)
    timed, busy = t.lines()
    assert timed.startswith("timed: node median 0.720 s (0.700-0.730), plain 2.60 s (2.40-4.60) over 5 interleaved "
                            "warm runs each: 3.61x; CPU ")
    assert ", load " in timed
    assert busy == "plain: GPU busy not measured (no CUDA device); node: GPU busy not measured (no CUDA device)"


def test_a_side_beside_runs_third_in_each_round_unprofiled(monkeypatch):
    """A third side for context (plain alone beside plain with a stack): run after the two in every round, so a drift
    falls on it alike; its median and how it compares with each side in a line of its own; not profiled."""
    calls: list[str] = []
    monkeypatch.setattr(timing, "gpu_busy", lambda run: (0.5, {}, {}))
    t = timing.measure(fake("node", [1.0] * 5, calls), fake("plain", [2.0] * 5, calls), gpu=True,
                       beside=("plain alone", fake("alone", [3.0, 3.2, 2.8, 3.0, 3.0], calls)))
    assert calls == ["node", "plain", "alone"] * timing.RUNS
    assert (t.beside.median, t.beside.low, t.beside.high, t.beside_label) == (3.0, 2.8, 3.2, "plain alone")
    assert t.lines()[2] == ("plain alone, run third in the same rounds: median 3.00 s (2.80-3.20), 3.00x the node's, "
                            "1.50x plain's")
    alone = timing.measure(fake("n", [1.0] * 5, []), fake("p", [1.0] * 5, []), gpu=False)
    assert len(alone.lines()) == 2
    # Without a GPU (the suite's harness on tiny models) the timing runs CPU_RUNS of each unless told; with one, RUNS
    assert len(alone.node.samples) == len(alone.plain.samples) == timing.CPU_RUNS < timing.RUNS


def test_an_even_count_takes_the_middle_two():
    assert timing.Spread.of([4.0, 1.0, 3.0, 2.0]).median == 2.5
    with pytest.raises(ValueError):
        timing.Spread.of([])


def test_seconds_a_step_and_gpu_busy(monkeypatch):
    calls: list[str] = []
    gelu = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::gelu_kernel_impl("
            "at::TensorIteratorBase&)::{lambda()#1}, std::array<char*, 2ul> >(int, c10::BFloat16)")
    gemms = {f"nvjet_tst_{i}": 0.5 + i for i in range(5)}  # 0.5 ... 4.5
    monkeypatch.setattr(timing, "gpu_busy", lambda run: {
        "node": (9.0, {"gemm": 6.0, "copy": 3.0}, {**gemms, "Memcpy DtoD (Device -> Device)": 3.0}),
        "plain": (6.0, {"attention": 2.0, "gemm": 4.0, "elementwise/other": 1.0, "norm": 0.5, "copy": 0.25},
                  {"nvjet_tst_0": 4.0, "flash_fwd_kernel": 2.0, gelu: 1.0, "rms_norm_kernel": 0.5,
                   "Memcpy HtoD (Pageable -> Device)": 0.25})}[run.__name__])
    node, plain = fake("node", [10.0] * 5, calls), fake("plain", [30.0] * 5, calls)
    node.__name__, plain.__name__ = "node", "plain"
    t = timing.measure(node, plain, gpu=True, per=5, unit="s/step")
    assert (t.node.median, t.plain.median, t.ratio) == (2.0, 6.0, 3.0)
    assert t.lines()[0].startswith("timed: node median 2.00 s/step (2.00-2.00), plain 6.00 s/step (6.00-6.00)")
    assert t.lines()[1] == ("plain: GPU busy 1.20 s/step of 6.00 s/step wall (20%); "
                            "node: GPU busy 1.80 s/step of 2.00 s/step wall (90%)")
    # where each side's GPU time went, the longest class first, per step as the rest
    assert t.lines()[2] == ("GPU time by kernel class (summed, streams overlapping counted apart), plain: gemm 0.800, "
                            "attention 0.400, elementwise/other 0.200, norm 0.100, copy 0.0500 s/step; node: gemm "
                            "1.20, copy 0.600 s/step")
    # and in each of the CLASSES longest classes its KERNELS longest kernels by name, boilerplate dropped, long names
    # cut (the functor that says which elementwise kernel it is kept); copies by name too, though not among them
    assert (timing.CLASSES, timing.KERNELS) == (4, 3)
    assert t.lines()[3] == ("plain's longest kernels (s/step): gemm: nvjet_tst_0 0.800; attention: flash_fwd_kernel "
                            "0.400; elementwise/other: vectorized_elementwise_kernel<4, gelu_kernel_impl(TensorI... "
                            "0.200; norm: rms_norm_kernel 0.100; copy: Memcpy HtoD (Pageable -> Device) 0.0500")
    assert t.lines()[4] == ("node's longest kernels (s/step): gemm: nvjet_tst_4 0.900, nvjet_tst_3 0.700, "
                            "nvjet_tst_2 0.500; copy: Memcpy DtoD (Device -> Device) 0.600")


def test_a_profiler_that_fails_is_said_not_raised(monkeypatch):
    def broken(run):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")

    monkeypatch.setattr(timing, "gpu_busy", broken)
    calls: list[str] = []
    t = timing.measure(fake("node", [1.0] * 5, calls), fake("plain", [2.0] * 5, calls), gpu=True)
    assert t.node_busy.seconds is None and t.ratio == 2.0
    assert t.lines()[1] == ("plain: GPU busy not measured (RuntimeError: CUPTI_ERROR_NOT_INITIALIZED); node: GPU busy "
                            "not measured (RuntimeError: CUPTI_ERROR_NOT_INITIALIZED)")


def test_overlapping_kernels_count_once():
    assert timing.union_length([(0, 10), (5, 15), (20, 25), (21, 22), (30, 30)]) == 20
    assert timing.union_length([]) == 0


def test_cpu_model_and_figures():
    info = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)  Platinum 8480+\nprocessor\t: 1\n"
    assert timing.cpu_model(info) == "Intel(R) Xeon(R) Platinum 8480+"
    assert timing.cpu_model("processor\t: 0\nCPU part\t: 0xd4f\n") == ""
    assert timing.host_cpu().endswith(" cores)")
    assert [timing.figure(v) for v in (0.7, 0.717, 3.264, 12.34, 123.4, 0.01234)] == \
        ["0.700", "0.717", "3.26", "12.3", "123", "0.0123"]


def test_the_tables_show_the_medians_and_the_timed_lines():
    """The suite's tables (sequences.Report, gpus.GpuReport) carry the timed lines and the host's CPU and load."""
    import gpus
    import sequences

    times = itertools.cycle([0.7, 3.0])
    t = timing.measure(lambda: next(times), lambda: next(times), gpu=False)
    row = sequences.Row("sdxl", "auto, graphs on", sequences.TIMED, 1e-4, 1e-3, True, t.node.median,
                        t.plain.median, 20, 0, t)
    report = sequences.Report("sdxl", "Some CPU (16 cores)", 1.5, rows=[row])
    table = report.table().splitlines()
    assert table[0].endswith("; CPU Some CPU (16 cores), load 1.50")
    assert "  0.700   3.000" in table[2] and table[2].endswith("ok")
    assert table[3].startswith("   timed: node median 0.700 s (0.700-0.700), plain 3.00 s") and "4.29x" in table[3]
    assert table[4].startswith("   plain: GPU busy not measured")
    check = gpus.GpuReport("wan21-14b-gpus", 1e-3, t)
    assert check.table().splitlines()[1].startswith("   timed: node median")


def test_gpu_busy_reads_the_busiest_gpus_events_by_class():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(device, index, start, end, name="kernel"):
        return SimpleNamespace(device_type=device, device_index=index, time_range=SimpleNamespace(start=start, end=end),
                               name=name)

    events = [event(DeviceType.CPU, 7, 0, 1e6, "cudaLaunchKernel"),  # a launch call on the CPU: no GPU work
              # two streams overlapping: busy once, each class its own time
              event(DeviceType.CUDA, 0, 0, 2e5, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"),
              event(DeviceType.CUDA, 0, 1e5, 3e5, "Memcpy HtoD (Pinned -> Device)"),
              event(DeviceType.CUDA, 1, 0, 1e5, "flash_fwd_kernel")]  # a less busy GPU: not counted
    seconds, classes, kernels = timing.device_busy(events)
    assert seconds == pytest.approx(0.3)
    assert classes == pytest.approx({"gemm": 0.2, "copy": 0.2})
    assert kernels == pytest.approx({"nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": 0.2,
                                     "Memcpy HtoD (Pinned -> Device)": 0.2})
    assert timing.kernel_class("Memset (Device)") == "memset"
    assert timing.kernel_class("ncclDevKernel_AllToAll") == "collective"
    with pytest.raises(RuntimeError, match="no GPU activity"):
        timing.device_busy(events[:1])


def test_more_timed_runs_only_when_asked_and_never_fewer_than_a_figure_needs():
    assert timing.timed_runs({}) == timing.MIN_RUNS
    assert timing.timed_runs({"SD_ACCEL_GPU_TIMED_RUNS": "11"}) == 11
    for bad in ("3", "eleven", "-7"):
        with pytest.raises(ValueError, match="SD_ACCEL_GPU_TIMED_RUNS"):
            timing.timed_runs({"SD_ACCEL_GPU_TIMED_RUNS": bad})


def _cond_copy():
    warnings.warn(timing.SYNC_WARNING)  # where torch would warn: a copy from the CPU that waits for the GPU


def _item():
    warnings.warn(timing.SYNC_WARNING)


def test_where_the_cpu_waited_for_the_gpu_by_place_the_most_first():
    """One more run under torch's sync debug mode: each wait's place (its innermost frames outside torch), counted;
    other warnings are no waits; the mode is set to warn for the run alone."""
    modes: list[str] = []

    def run():
        for _ in range(3):
            _cond_copy()
        _item()
        warnings.warn("some other warning")

    waits = timing.host_waits(run, set_mode=modes.append)
    assert modes == ["warn", "default"]
    assert waits.count == 4
    (first, n1), (second, n2) = waits.sites
    assert (n1, n2) == (3, 1)
    assert first.startswith("tests/test_gpu_timing.py:") and " _cond_copy < tests/test_gpu_timing.py:" in first
    assert first.endswith(" run") and " _item < " in second
    assert _timed_with(waits).lines()[-1] == ("the CPU waited for the GPU, in one more run: plain 0; node 4 ("
                                              f"{first} x3; {second} x1)")


def _timed_with(node_waits):
    t = timing.measure(fake("node", [1.0], []), fake("plain", [2.0], []), gpu=False, runs=1)
    return dataclasses.replace(t, plain_waits=timing.Waits(0), node_waits=node_waits)


def test_a_sync_debug_mode_that_cannot_be_set_is_said_and_the_run_not_made():
    calls: list[str] = []

    def cannot(mode):
        raise AssertionError("Torch not compiled with CUDA enabled")

    waits = timing.host_waits(fake("node", [1.0], calls), set_mode=cannot)
    assert calls == [] and waits.count is None
    assert waits.text("node") == "node not measured (AssertionError: Torch not compiled with CUDA enabled)"
