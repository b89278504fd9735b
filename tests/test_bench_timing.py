"""How `bench` times a row against eager (accel/cli/bench.py time_pair, issue 58), on the CPU: eager's calls and the
row's alternate, each after its switch (an sd-accel path suspended for eager, resumed for itself), each side is its
median with its range, the ratio is of the medians, a speed-up rests on at least 5 runs of each side, and the CUDA
graph baseline's channels_last weights switch in their own storage."""

from __future__ import annotations

import torch

from sd_accel.accel.cli import bench, timing
from sd_accel.accel.models.configs import build_unet, example_inputs
from sd_accel.accel.models.spec import CanonicalUNet

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # a device object only: nothing runs on GPU here


def test_time_pair_alternates_eager_first_and_takes_each_sides_median(monkeypatch):
    calls: list[str] = []
    # one warm-up pair, then eager's and the path's times in turn; eager's are skewed (mean 30, median 22)
    times = iter([99.0, 99.0, 22.0, 10.0, 60.0, 11.0, 20.0, 12.0, 21.0, 10.5, 27.0, 11.5])
    monkeypatch.setattr(bench, "call_ms", lambda fn, device: (fn(), next(times))[1])
    base, own = bench.time_pair(lambda: calls.append("eager"), lambda: calls.append("path"), CPU, 5,
                                to_base=lambda: calls.append("to eager"), to_fn=lambda: calls.append("to path"),
                                warmup=1)
    assert calls == ["to eager", "eager", "to path", "path"] * 6
    assert base.record() == {"median": 22.0, "min": 20.0, "max": 60.0, "times": [22.0, 60.0, 20.0, 21.0, 27.0]}
    assert own.record() == {"median": 11.0, "min": 10.0, "max": 12.0, "times": [10.0, 11.0, 12.0, 10.5, 11.5]}
    row = bench.timed_row("m", "sd-accel torch", own, base, GPU, rel_err=0.0)
    assert (row.ms, row.speedup) == (11.0, 2.0)
    assert row.timed == own.record() and row.baseline == base.record()
    assert bench.timed_row("m", "sd-accel torch", own, base, CPU).speedup is None  # no ratio on the CPU


def test_the_table_shows_ranges_and_on_a_gpu_eager_beside_each_ratio():
    eager = timing.Spread.of([20.0, 22.0, 21.0])
    rows = [bench.timed_row("sdxl", "eager (SDPA)", eager, None, GPU, peak_gb=8.0, rel_err=1e-3),
            bench.timed_row("sdxl", "sd-accel torch", timing.Spread.of([10.0, 11.0, 12.0]),
                            timing.Spread.of([22.0, 23.0, 21.5]), GPU, peak_gb=8.5, rel_err=1e-3, setup_s=3.0)]
    lines = bench.table(rows, bench.host_line("Some CPU (16 cores)", 1.5)).splitlines()
    assert lines[0].split() == ["model", "variant", "ms/step", "min-max", "eager", "ms", "speedup", "peak", "GB",
                                "rel", "err", "setup", "s"]
    assert lines[2].split()[3:7] == ["21.00", "20.00-22.00", "-", "1.00"]  # eager's own row: its runs alone
    assert lines[3].split()[3:7] == ["11.00", "10.00-12.00", "22.00", "2.00"]
    assert any(line.startswith("ms/step = median of the row's timed calls") and "interleaved with eager" in line
               for line in lines)
    assert any(line.startswith("eager ms = eager's median over the runs interleaved") for line in lines)
    assert lines[-1] == "host: CPU Some CPU (16 cores), load 1.50 (1-minute average, after the timed runs)"
    cpu = bench.table([bench.timed_row("tiny-sdxl", "eager (SDPA)", eager, None, CPU)]).splitlines()
    assert "speedup" not in cpu[0] and "eager ms" not in cpu[0] and "min-max" in cpu[0]


def test_a_speedup_rests_on_at_least_five_runs_of_each_side(monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_unet", lambda name, device, dtype, iters, *rest: seen.append(iters) or [])
    said: list[str] = []
    bench.run(["sd15"], tiny=False, iters=2, compile_modes=[], paths=["torch"], log=said.append)
    assert seen == [timing.MIN_RUNS] and said[0].startswith("--iters 2: a speed-up is printed from at least 5")
    bench.run(["sd15"], tiny=False, iters=7, compile_modes=[], paths=["torch"], log=said.append)
    assert seen[-1] == 7 and len(said) == 1


def test_the_graph_baselines_weights_switch_layout_in_their_own_storage():
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 8, 1))
    values = [p.detach().clone() for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    to_eager, to_graphed = bench.channels_last_switches(model)
    weights = [model[0].weight, model[1].weight]

    def strides(memory_format: torch.memory_format) -> list[tuple[int, ...]]:
        return [torch.empty(w.shape, memory_format=memory_format).stride() for w in weights]

    assert [w.stride() for w in weights] == strides(torch.channels_last)  # the 1x1 one's explicitly too
    for switch, memory_format in ((to_eager, torch.contiguous_format), (to_eager, torch.contiguous_format),
                                  (to_graphed, torch.channels_last)):
        switch()
        assert [w.stride() for w in weights] == strides(memory_format)
        assert [p.data_ptr() for p in model.parameters()] == ptrs  # where a captured graph reads them
        assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))


def test_the_bench_interleaves_eager_with_the_suspended_path(monkeypatch):
    """The path's row: after its build and first calls, eager on the plain model (the path suspended) and the path
    (resumed) alternate, the warm-up pairs and then --iters of each; graphs captured meanwhile are said."""
    from sd_accel.accel import accelerate as A

    events: list[str] = []
    inside: list[A.AcceleratedUNet] = []
    suspended: list[bool] = []
    plain_call, plain_forward = A.AcceleratedUNet.__call__, CanonicalUNet.forward
    plain_suspend, plain_resume = A.AcceleratedUNet.suspend, A.AcceleratedUNet.resume

    def call(self, *args, **kwargs):
        events.append("path")
        inside.append(self)
        try:
            return plain_call(self, *args, **kwargs)
        finally:
            inside.pop()

    def forward(self, *args, **kwargs):
        if not inside:
            events.append("eager")
            if accs:
                suspended.append(accs[-1].engine.suspended)
        return plain_forward(self, *args, **kwargs)

    accs: list[A.AcceleratedUNet] = []

    def suspend(self):
        events.append("suspend")
        accs.append(self)
        plain_suspend(self)

    def resume(self):
        events.append("resume")
        plain_resume(self)

    monkeypatch.setattr(A.AcceleratedUNet, "__call__", call)
    monkeypatch.setattr(A.AcceleratedUNet, "suspend", suspend)
    monkeypatch.setattr(A.AcceleratedUNet, "resume", resume)
    monkeypatch.setattr(CanonicalUNet, "forward", forward)
    # graphs (none on the CPU) counted before and after the interleaved calls: as if a resume had lost them
    captures = iter([3, 5])
    monkeypatch.setattr(bench, "_captures", lambda acc: next(captures))
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=3))
    args = example_inputs(unet.unet, latent=16, seed=4)
    with torch.inference_mode():
        ref = plain_forward(unet, *args)
    rows = bench.time_variants("tiny-sd15", unet, args, ref, CPU, 5, [], ["torch"], log=lambda s: None)
    assert [r.variant for r in rows] == ["eager (SDPA)", "sd-accel torch"]
    assert events[:9] == ["eager"] * 9  # eager's own row: a first call, 3 warm-up calls, 5 timed
    assert events[-32:] == ["suspend", "eager", "resume", "path"] * 8  # 3 warm-up pairs, then 5 timed pairs
    assert suspended and all(suspended)  # eager ran the plain model
    eager, ours = rows
    assert eager.baseline is None and len(eager.timed["times"]) == 5
    assert len(ours.timed["times"]) == len(ours.baseline["times"]) == 5
    assert ours.ms == ours.timed["median"] and ours.timed["min"] <= ours.ms <= ours.timed["max"]
    assert ours.rel_err <= 1e-5 and ours.speedup is None
    assert ours.note == "2 CUDA graph captures while timed against eager (suspend/resume lost the graphs)"
    assert "captures while timed" in bench.table(rows)
