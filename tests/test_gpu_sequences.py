"""The GPU suite's sequences (tests/gpu/sequences.py) on tiny models on the CPU: the same harness, ComfyUI's own
classes and sampler, every run of the node against plain ComfyUI's. On the CPU the torch path runs the plain
model's float32 kernels, so each run must equal plain's exactly (the yardstick is 0) and go through the engine."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import comfy_helpers as H

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import sequences  # noqa: E402
import timing

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


@pytest.mark.parametrize("name", ["sd15", "sdxl-fp8weights", "flux-dev", "chroma", "wan21-1.3b", "qwen-image",
                                  "z-image", "hunyuan-video15", "ltx2-8l", "flux2-dev-10l"])
def test_every_run_of_the_sequence_equals_plain_comfyui(name):
    H.import_comfy()
    import comfy.supported_models

    if not hasattr(comfy.supported_models, sequences.MODELS[name][0]):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no supported_models.{sequences.MODELS[name][0]}")
    report = sequences.run_model(name, size="tiny", device="cpu")
    runs, settings = {r.run for r in report.rows}, {r.setting for r in report.rows}
    assert {"20 steps again", "LoRA 0.4", "LoRA removed", "after unload", "other size", "batch 2"} <= runs
    assert {"widget: back", "two nodes: B"} <= settings
    assert report.yardstick == 0.0 and not report.failures(), report.table()
    assert report.lora_effect > 1e-3  # the LoRA runs compare images the LoRA changed
    timed = [r for r in report.rows if r.run == sequences.TIMED]
    assert timed and all(len(r.timed.node.samples) == len(r.timed.plain.samples) == timing.CPU_RUNS for r in timed)
    assert all(r.seconds == r.timed.node.median and r.plain_seconds == r.timed.plain.median for r in timed)
    fp8_rows = [r for r in report.rows if r.setting.startswith("fp8")]
    if name in sequences.UNETS:
        assert report.fp8_yardstick is None and not fp8_rows
    else:  # plain ComfyUI's own fp8 weight dtype rounds the weights to e4m3: its latents move, and bound fp8's
        assert report.fp8_yardstick > 1e-3 and fp8_rows, report.table()
        assert all(r.limit == 1.5 * report.fp8_yardstick for r in fp8_rows)
    int8_rows = [r for r in report.rows if r.setting.startswith("int8")]
    assert bool(int8_rows) == (name in sequences.INT8)  # the int8 products' runs, within fp8's limit
    assert all(r.limit == 1.5 * report.fp8_yardstick for r in int8_rows)
    print(report.table())


def test_the_timed_runs_alone_run_the_first_20_steps_and_the_timed_run_of_each_setting():
    """SD_ACCEL_GPU_RUNS=timed: each setting's first 20-step run (compared with plain's) and its timed run, no LoRA
    runs or widget changes, and no failure for a LoRA effect that was not measured; any other value is refused."""
    report = sequences.run_model("sd15", size="tiny", device="cpu", runs="timed")
    settings = {r.setting for r in report.rows}
    assert settings and not any(s.startswith(("widget", "two nodes")) for s in settings)
    for setting in settings:
        assert [r.run for r in report.rows if r.setting == setting] == ["20 steps", sequences.TIMED]
    timed = [r for r in report.rows if r.run == sequences.TIMED]
    assert all(len(r.timed.node.samples) == len(r.timed.plain.samples) == timing.CPU_RUNS for r in timed)
    assert report.lora_effect == 0.0 and not report.failures(), report.table()
    assert "LoRA's effect on plain not measured" in report.table().splitlines()[0]
    said = [n for n in report.notes if n.startswith("said: ")]  # the node's console lines, each once
    assert said and len(said) == len(set(said)) and any("path is ready" in n for n in said), report.notes
    with pytest.raises(ValueError, match="SD_ACCEL_GPU_RUNS='lora': use all or timed"):
        sequences.run_model("sd15", size="tiny", device="cpu", runs="lora")


def test_comfyuis_detection_takes_the_reduced_flux2_file_for_flux2():
    """flux2-dev-10l's file, as the suite writes it on the GPU (its model's state dict; here built on the meta device:
    the keys and shapes without weights), is one ComfyUI's own detection takes for supported_models.Flux2 with the
    suite's config: full width, 2 double and 8 single blocks, Mistral's 15360-wide text; 6.7B parameters. The suite
    loads the full-size file with no help from comfy_helpers.detected_as."""
    H.import_comfy()
    import comfy.model_detection
    import comfy.supported_models
    import torch

    from sd_accel.accel.models import configs

    if not hasattr(comfy.supported_models, "Flux2"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no supported_models.Flux2")
    name = "flux2-dev-10l"
    cls, config_name = sequences.MODELS[name][:2]
    _, cfg = configs.comfy_dit_config(config_name)
    config = getattr(comfy.supported_models, cls)(dict(cfg))
    config.unet_config.update(cfg)
    with H.layers_with_weights(), torch.device("meta"):
        state = config.get_model({}, device="meta").diffusion_model.state_dict()
    found = comfy.model_detection.model_config_from_unet(state, "")
    assert type(found).__name__ == cls == "Flux2"
    assert {k: found.unet_config.get(k) for k in cfg} == cfg
    assert (found.unet_config["depth"], found.unet_config["depth_single_blocks"]) == (2, 8)
    assert cfg["context_in_dim"] == configs.COMFY_DIT_CONFIGS["flux2-dev"][1]["context_in_dim"] == 15360
    assert 6.6e9 < sum(t.numel() for t in state.values()) < 6.8e9


def test_the_yardstick_measured_alone_serves_a_later_run(tmp_path, monkeypatch):
    """SD_ACCEL_GPU_YARDSTICK: a call that measures only the yardstick, and a later one that takes it from that call's
    report; the later run's limits are the given yardstick's, and a report of another model is refused."""
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", "only")
    alone = sequences.run_model("sd15", size="tiny", device="cpu")
    assert not alone.rows and not alone.sequences and not alone.failures()
    path = tmp_path / "sd15.json"
    path.write_text(json.dumps({"model": "sd15", "yardstick": 2e-3}))
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", str(path))
    report = sequences.run_model("sd15", size="tiny", device="cpu", only="no setting: the widget changes alone")
    assert report.yardstick == 2e-3 and any(str(path) in note for note in report.notes)
    assert report.rows and {r.limit for r in report.rows} == {2e-3 * 1.5} and not report.failures(), report.table()
    path.write_text(json.dumps({"model": "flux-dev", "yardstick": 2e-3}))
    with pytest.raises(SystemExit, match="holds no yardstick of sd15"):
        sequences.run_model("sd15", size="tiny", device="cpu")


def test_a_transformers_fp8_yardstick_measured_alone_serves_a_later_run(tmp_path, monkeypatch):
    """With fp8 settings chosen, SD_ACCEL_GPU_YARDSTICK=only measures the fp8 yardstick too, and a report holding one
    gives it to a later run: its fp8 rows' limits are 1.5 times the given value, and no scaled fp8 file is written."""
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", "only")
    alone = sequences.run_model("flux-dev", size="tiny", device="cpu", only="fp8")
    assert not alone.rows and alone.fp8_yardstick > 1e-3, alone.table()
    path = tmp_path / "flux-dev.json"
    path.write_text(json.dumps({"model": "flux-dev", "yardstick": 1e-3, "fp8_yardstick": 5e-2}))
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", str(path))
    monkeypatch.setattr(sequences.Harness, "measure_fp8_yardstick", lambda self: pytest.fail("measured, not taken"))
    report = sequences.run_model("flux-dev", size="tiny", device="cpu", only="fp8", runs="timed")
    assert report.fp8_yardstick == 5e-2 and any(f"fp8 yardstick 5.00e-02 from {path}" in n for n in report.notes)
    assert report.rows and {r.limit for r in report.rows} == {5e-2 * 1.5} and not report.failures(), report.table()


def test_a_call_cut_off_in_its_sequences_leaves_its_yardsticks_for_the_next(tmp_path, monkeypatch):
    """With SD_ACCEL_GPU_REPORT, the yardsticks are written as soon as they are measured: a call its time limit ends
    before any report leaves NAME.yardstick.json, which SD_ACCEL_GPU_YARDSTICK gives the next call (no float32 runs)."""
    monkeypatch.setenv("SD_ACCEL_GPU_REPORT", str(tmp_path))
    monkeypatch.delenv("SD_ACCEL_GPU_YARDSTICK", raising=False)

    def cut(*args, **kwargs):
        raise KeyboardInterrupt("the call's time limit")

    with monkeypatch.context() as m:
        m.setattr(sequences.Harness, "check", cut)
        with pytest.raises(KeyboardInterrupt):
            sequences.run_model("flux-dev", size="tiny", device="cpu", only="fp8", runs="timed")
    path = tmp_path / "flux-dev.yardstick.json"
    left = json.loads(path.read_text())
    assert left["model"] == "flux-dev" and left["fp8_yardstick"] > 1e-3 and not (tmp_path / "flux-dev.json").exists()
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", str(path))
    monkeypatch.setattr(sequences.Harness, "measure_yardstick", lambda self: pytest.fail("measured, not taken"))
    monkeypatch.setattr(sequences.Harness, "measure_fp8_yardstick", lambda self: pytest.fail("measured, not taken"))
    report = sequences.run_model("flux-dev", size="tiny", device="cpu", only="fp8", runs="timed")
    assert report.fp8_yardstick == left["fp8_yardstick"] and report.rows and not report.failures(), report.table()


def test_the_changes_alone_run_the_lora_unload_and_widget_runs_each_equal_to_plain(monkeypatch):
    """SD_ACCEL_GPU_RUNS=changes: a first run, then a LoRA added, changed and removed, an unload, and the widget
    changes; each run equal to plain's, the LoRA's effect on plain measured (a LoRA that changed nothing would fail)."""
    monkeypatch.delenv("SD_ACCEL_GPU_YARDSTICK", raising=False)
    report = sequences.run_model("sd15", size="tiny", device="cpu", only="auto", runs="changes")
    assert [r.run for r in report.rows if r.setting == "auto, graphs off"] == [
        "7 steps", "LoRA 1.0", "LoRA 0.4", "LoRA removed", "after unload"]
    assert any(r.setting.startswith("widget") for r in report.rows) and report.lora_effect > 1e-3, report.table()
    assert not report.failures(), report.table()


def test_int8_settings_alone_measure_the_fp8_yardstick_their_widget_changes_are_held_to(monkeypatch):
    """int8 settings chosen alone (SD_ACCEL_GPU_SETTINGS="int8, ..."): the fp8 yardstick is measured as for fp8, which
    bounds the int8 rows and the widget changes' fp8 node alike."""
    H.import_comfy()
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "ZImage"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no supported_models.ZImage")
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", "only")
    alone = sequences.run_model("z-image", size="tiny", device="cpu", only="int8")
    assert not alone.rows and alone.fp8_yardstick > 1e-3, alone.table()


def test_the_several_gpu_check_on_cpu_processes():
    """tests/gpu/gpus.py's check on the tiny Wan, its spread run over 2 CPU processes, twice: every call spread, the
    latents within the measured limit of the 1-GPU run's; the second run's seconds with no start of the workers in
    them."""
    import gpus

    report = gpus.run_check("wan21-14b-gpus", size="tiny", device="cpu", gpus=("2",))
    print(report.table())
    assert [r.setting for r in report.rows] == ["gpus 1", "gpus 1, warm (moved noise)", "gpus 2", "gpus 2, again"]
    for spread in report.rows[2:]:
        assert spread.devices == 2 and spread.spread_calls == spread.engine_calls == gpus.STEPS
        assert 0 < spread.distance
    assert report.rows[2].start > 0 and report.rows[3].start == 0
    assert len(report.timed.node.samples) == len(report.timed.plain.samples) == timing.CPU_RUNS
    assert not report.failures(), report.table()


def test_the_several_gpu_fp8_check_spreads_again_after_an_unload():
    """The fp8 check's last run follows ComfyUI's unload: the node's workers went with the model and a new pool
    serves every call (on the CPU the node runs 16-bit: its fp8 products need a GPU)."""
    import gpus

    report = gpus.run_check("wan21-1.3b-gpus-fp8", size="tiny", device="cpu", gpus=("2",))
    print(report.table())
    assert [r.setting for r in report.rows][2:] == ["gpus 2", "gpus 2, again", "gpus 2 after unload"]
    first, last = report.rows[2], report.rows[-1]
    assert last.devices == 2 and last.spread_calls == last.engine_calls == gpus.STEPS
    assert last.start > 0 and last.start != first.start  # its workers started again, not the first run's start
    assert not report.failures(), report.table()


def test_a_run_off_plain_fails():
    row = sequences.Row("m", "s", "r", error=2e-3, limit=1e-3, finite=True, engine_calls=3)
    assert not row.ok
    assert not dataclasses_replace(row, error=0.0, finite=False).ok
    assert not dataclasses_replace(row, error=0.0, plain_calls=1).ok  # the plain model ran: nothing was compared
    assert dataclasses_replace(row, error=0.0).ok


def dataclasses_replace(row, **changes):
    import dataclasses

    return dataclasses.replace(row, **changes)


@pytest.fixture
def stacking_on_the_cpu(monkeypatch):
    """tests/gpu/stacking.py on the CPU: TorchCompileModel's torch.compile with dynamo's eager backend (inductor takes
    minutes on a CPU; what the node meets is dynamo's tracing, whatever the backend), and `--fast fp16_accumulation`
    run in its own process although ComfyUI leaves it off here (its stack's plumbing is what is tested)."""
    import torch

    import stacking

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, **{**kw, "backend": "eager",
                                                                                "options": None}))
    own = stacking.unavailable
    monkeypatch.setattr(stacking, "unavailable",
                        lambda flag, device: None if flag == "--fast fp16_accumulation" else own(flag, device))
    return stacking


@pytest.mark.parametrize("mode", ["stack-sd15", "stack-sd15-tools", "stack-flux-dev", "stack-flux-dev-controlnet"])
def test_the_stacks_give_plains_latents_and_skip_the_same_steps(stacking_on_the_cpu, mode):
    """Each stack of the mode on its tiny model: the node with the stack against plain ComfyUI with it, latents
    compared within the limit (on the CPU the torch path runs the plain model's kernels: exact in 16-bit settings,
    within the fp8 bound for Flux's fp8), the caches' skipped steps equal in every run, the compiled model
    left to ComfyUI with one message, the flag's own process, sage skipped in one line."""
    stacking = stacking_on_the_cpu
    reports = stacking.run_mode(mode, size="tiny", device="cpu")
    tables = "\n".join(r.table() for r in reports)
    print(tables)
    by = {r.stack: r for r in reports}
    assert set(by) == set(stacking.MODES[mode][1]), tables
    assert not [f for r in reports for f in r.failures()], tables
    for r in reports:
        if r.skipped:
            assert r.table().count("\n") == 0 and "skipped: " in r.table()
            continue
        assert r.rows and all(row.ok and row.timed and len(row.timed.node.samples) == timing.CPU_RUNS
                              for row in r.rows)
        assert [row.order for row in r.rows] == list(stacking.STACKS[r.stack].orders)
        fp8 = stacking.PRECISION.get(r.model) == "fp8"
        assert all((row.limit > 0 and row.error <= row.limit) if fp8 else row.error == 0.0 for row in r.rows)
    for cache in set(by) & {"EasyCache", "LazyCache"}:
        for row in by[cache].rows:
            assert row.skipped and 0 < row.skipped[0] < row.steps, by[cache].table()
            assert len(row.skipped) == len(row.plain_skipped) == 1 + timing.CPU_RUNS
    if "ControlNet" in by:  # it changed plain's image, and the node's runs took its residuals
        assert by["ControlNet"].effect > 1e-3
    if mode == "stack-sd15-tools":
        assert "needs a CUDA GPU" in by["--use-sage-attention"].skipped
        fast = by["--fast fp16_accumulation"]
        assert fast.rows[0].flag_on is False and "not in effect here" in fast.table()
        compiled = by["TorchCompileModel"].rows[0]
        assert compiled.said == 1 and compiled.engine_calls == 0


def test_a_sage_stack_whose_calls_all_fall_back_is_skipped_not_timed(stacking_on_the_cpu, monkeypatch, tmp_path):
    """sageattention 1.x takes head sizes 64, 96 and 128: at SD1.5's (40, 80, 160) it raises at every call, and ComfyUI
    logs an error and runs PyTorch's attention instead. Timed, that stack would be the errors against the node, not
    sage: it is skipped in one line that says so. A sageattention that refuses every call stands in for it here, in the
    flag's own process on the CPU."""
    stacking = stacking_on_the_cpu
    (tmp_path / "sageattention").mkdir()
    (tmp_path / "sageattention" / "__init__.py").write_text(
        "def sageattn(q, k, v, **kwargs):\n    raise ValueError('headdim should be in [64, 96, 128].')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(stacking, "unavailable", lambda flag, device: None)
    monkeypatch.setitem(stacking.MODES, "stack-sage", ("sd15", ("--use-sage-attention",)))
    (report,) = stacking.run_mode("stack-sage", size="tiny", device="cpu")
    assert "sage attention refused" in report.skipped and "headdim should be in [64, 96, 128]" in report.skipped, \
        report.table()
    assert not report.failures() and report.table().count("\n") == 0


def test_the_split_over_two_devices_against_the_nodes_own_and_with_the_node_stepping_aside():
    """stack-sdxl-multigpu on the tiny SDXL (ComfyUI 0.33's MultiGPU CFG Split): plain with the split (its second
    device a second CPU index) against the node with gpus 2 (two CPU processes), every call spread, its latents within
    the limit of plain's with and without the split; then the node with the split before and after it: ComfyUI's
    forward serves each device's call (cond and uncond apart), said once over two runs, plain's latents exactly."""
    import stacking

    H.import_comfy()
    if H.host_node("nodes_multigpu", "MultiGPUCFGSplitNode")[0] is None:
        pytest.skip(f"ComfyUI {H.comfy_version()} has no MultiGPU CFG Split")
    (report,) = stacking.run_mode("stack-sdxl-multigpu", size="tiny", device="cpu")
    table = report.table()
    print(table)
    assert not report.failures() and not report.raised, table
    assert [r.order for r in report.rows] == ["gpus 2", "before", "after"], table
    steps = stacking.steps("tiny")
    own, *aside = report.rows
    assert own.devices == 2 and own.spread_calls == own.engine_calls == steps and own.plain_calls == 0
    assert own.error <= own.limit and own.vs_plain <= own.limit
    assert own.timed and len(own.timed.beside.samples) == len(own.timed.node.samples) == timing.CPU_RUNS
    assert own.timed.beside_label == "plain alone (no split)" and "run third in the same rounds" in table
    for row in aside:
        assert row.devices == 2 and row.said == 1 and row.error == 0.0 and row.timed is None
        assert row.engine_calls == 0 and row.plain_calls == 2 * steps  # one call a step on each device
        assert "x " not in row.line()  # one run of each side: no ratio (issue 58)
    assert f"{own.plain_seconds / own.seconds:.2f}x" in own.line()
    assert report.yardstick == pytest.approx(own.limit / 1.5)  # the run's (0 on the CPU) + the split's own move
    assert "plain's move under the split" in table


def test_the_split_is_skipped_in_one_line_without_its_node_or_a_second_gpu(monkeypatch):
    """Where ComfyUI has no MultiGPU CFG Split (0.3.64) the mode says so in one line before any model is built; on a
    machine with one GPU it needs 2."""
    import torch

    import stacking

    H.import_comfy()
    found, why = H.host_node("nodes_multigpu", "MultiGPUCFGSplitNode")
    if found is None:
        (report,) = stacking.run_mode("stack-sdxl-multigpu", size="tiny", device="cpu")
        assert report.skipped == why and not report.rows and not report.failures()
        assert report.table().count("\n") == 0 and "skipped: " in report.table()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert stacking.unavailable("MultiGPUCFGSplit", torch.device("cuda")) == (why or "needs 2 GPUs; 1 visible")


def test_a_split_row_that_did_not_split_fails():
    """The split's rows fail where a device is missing, a call was not spread, the node's own split lies off plain's
    without the split, or a step's cond and uncond ran together; the step-aside rows where the node said it more than
    once."""
    import dataclasses

    import stacking

    own = stacking.StackRow("gpus 2", 1e-4, 1e-3, True, 20, 20, 0, vs_plain=2e-4, devices=2, spread_calls=20)
    aside = stacking.StackRow("before", 0.0, 1e-3, True, 20, 0, 40, aside=True, said=1, devices=2)
    assert own.ok and aside.ok
    for bad, words in ((dataclasses.replace(own, vs_plain=2e-3), "without the split"),
                       (dataclasses.replace(own, devices=1), "nothing was split"),
                       (dataclasses.replace(own, spread_calls=19), "spread 19 of its 20"),
                       (dataclasses.replace(aside, plain_calls=20), "cond and uncond were not run apart"),
                       (dataclasses.replace(aside, said=2), "2 times, not once")):
        assert any(words in p for p in bad.problems()), bad.problems()


def test_a_node_off_plain_with_the_stack_fails(stacking_on_the_cpu, monkeypatch):
    """A wrong node: its latents moved (a post-CFG function on the node's output alone scales each step's result),
    its calls still through the engine: the stack's row fails, naming the distance."""
    stacking = stacking_on_the_cpu
    node = sequences.Harness.node

    def moved(self, model, *args, **kwargs):
        out = node(self, model, *args, **kwargs).clone()
        out.set_model_sampler_post_cfg_function(lambda a: a["denoised"] * 1.05)
        return out

    monkeypatch.setattr(sequences.Harness, "node", moved)
    monkeypatch.setitem(stacking.MODES, "stack-sd15", ("sd15", ("EasyCache",)))
    (report,) = stacking.run_mode("stack-sd15", size="tiny", device="cpu")
    print(report.table())
    assert report.failures() and all("over" in f for f in report.failures()), report.table()
    assert "FAIL" in report.table()


def test_a_stack_that_raises_fails_naming_the_exception(stacking_on_the_cpu, monkeypatch):
    """A stack whose set-up raises (on the GPU machine, ComfyUI's nodes.py without PyAV): the stack fails with the
    exception's first line and no row of made-up figures; the mode's other stacks still run."""
    stacking = stacking_on_the_cpu

    def broken(self, name):
        raise ModuleNotFoundError("No module named 'av'")

    monkeypatch.setattr(stacking.Stacker, "stack", broken)
    monkeypatch.setitem(stacking.MODES, "stack-sd15", ("sd15", ("EasyCache", "LazyCache")))
    reports = stacking.run_mode("stack-sd15", size="tiny", device="cpu")
    assert [r.stack for r in reports] == ["EasyCache", "LazyCache"]
    for r in reports:
        assert r.failures() == [f"sd15 + {r.stack}: raised ModuleNotFoundError: No module named 'av'"], r.table()
        assert not r.rows and "FAIL: raised ModuleNotFoundError" in r.table()


def test_modes_of_one_model_in_one_call_load_the_file_the_first_wrote(stacking_on_the_cpu, monkeypatch, tmp_path):
    """Two modes of one model in one call (`tests/gpu/run stack-flux-dev,stack-flux-dev-controlnet`): the second loads
    the 16-bit file the first wrote rather than seeding and writing the full-size model again (a Flux file is 24 GB, the
    GPU machine's disk 64 GB), through the call's SD_ACCEL_GPU_SHARED folder, as under DynamicVRAM, where each mode
    runs in a process of its own and the first one's folder is gone when the next starts; another model, or a file
    gone, is written anew; without the folder nothing is shared. Tiny models write no file: one stands in here for
    each mode's own, and the stacks themselves are left out."""
    stacking = stacking_on_the_cpu
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("SD_ACCEL_GPU_SHARED", str(shared))
    own = []

    def model_file(self):
        if self._file16 is not None:
            return self._file16
        own.append(tmp_path / f"own-{len(own)}" / "diffusion_model.safetensors")
        own[-1].parent.mkdir()
        own[-1].write_bytes(f"{self.name} weights".encode())
        return own[-1]

    monkeypatch.setattr(sequences.Harness, "model_file", model_file)
    given = []
    reuse = sequences.Harness.reuse_file
    monkeypatch.setattr(sequences.Harness, "reuse_file", lambda self, path: (given.append((self.name, path)),
                                                                               reuse(self, path)))
    monkeypatch.setattr(stacking.Stacker, "stack",
                        lambda self, name: stacking.StackReport(self.h.name, name, self.precision, 0.0))
    for mode, model in (("stack-a", "sd15"), ("stack-b", "sd15"), ("stack-c", "flux-dev")):
        monkeypatch.setitem(stacking.MODES, mode, (model, ("EasyCache",)))
    stacking.run_mode("stack-a", size="tiny", device="cpu")
    assert given == []
    shutil.rmtree(own[0].parent)  # the first mode's process ended, and its folder with it
    stacking.run_mode("stack-b", size="tiny", device="cpu")
    sd15 = shared / "sd15-tiny.safetensors"
    assert given == [("sd15", sd15)] and sd15.read_bytes() == b"sd15 weights"
    stacking.run_mode("stack-c", size="tiny", device="cpu")
    assert given == [("sd15", sd15)] and (shared / "flux-dev-tiny.safetensors").read_bytes() == b"flux-dev weights"
    sd15.unlink()
    stacking.run_mode("stack-b", size="tiny", device="cpu")
    assert given == [("sd15", sd15)] and sd15.is_file()
    monkeypatch.delenv("SD_ACCEL_GPU_SHARED")
    stacking.run_mode("stack-b", size="tiny", device="cpu")
    assert given == [("sd15", sd15)]


@pytest.mark.parametrize("name", ["two-models-plain", "two-models"])
def test_a_second_model_in_one_process_leaves_both_as_plain(name):
    """tests/gpu/two_models.py on tiny models: SD1.5, SDXL, SD1.5 again in one process, each visit's latents equal
    plain's (exactly on the CPU), every call of the node's visits through the engine."""
    import two_models

    report = two_models.run_pair(name, size="tiny", device="cpu")
    assert [v.model for v in report.visits] == list(two_models.MODELS), report.table()
    assert not report.failures(), report.table()
    if report.node:
        assert all(v.engine_calls > 0 and v.plain_calls == 0 for v in report.visits), report.table()


def test_a_first_model_served_wrongly_after_the_second_fails(monkeypatch):
    """A node whose first model comes out moved after the second model ran (its latents scaled on the third visit):
    that visit fails, naming the distance, and the others pass."""
    import two_models

    node, sample = sequences.Harness.node, sequences.Harness.sample
    accelerated, served = [], []

    def tracked(self, model, *args, **kwargs):
        accelerated.append(node(self, model, *args, **kwargs))
        return accelerated[-1]

    def moved_on_return(self, model, run, *args, **kwargs):
        out, seconds = sample(self, model, run, *args, **kwargs)
        if any(model is m for m in accelerated):
            served.append(self.name)
            if served.count("sd15") == 2:
                out = out * 1.05
        return out, seconds

    monkeypatch.setattr(sequences.Harness, "node", tracked)
    monkeypatch.setattr(sequences.Harness, "sample", moved_on_return)
    report = two_models.run_pair("two-models", size="tiny", device="cpu")
    failures = report.failures()
    assert len(accelerated) == 2, "each model gets one node, kept for its later visit"
    assert len(failures) == 1 and failures[0].startswith("two-models visit 3 (sd15): latents"), report.table()
