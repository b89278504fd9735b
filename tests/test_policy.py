"""Path policy over GPU families x installed packages x preferences."""

from __future__ import annotations

import importlib.util
import itertools
from types import SimpleNamespace

import pytest

from sd_accel.accel.plan.device import GpuInfo, cpu_info, info_from_properties
from sd_accel.accel.errors import BadInput
from sd_accel.accel.plan.options import OrtOptions, TorchOptions
from sd_accel.accel.plan.policy import ENV, ORT_PROVIDERS, PREFERENCES, Plan, choose, probe_packages

PK = {"triton": True, "flash_attn": False}


def _nv(major, minor):
    return info_from_properties(SimpleNamespace(name=f"nv{major}{minor}", major=major, minor=minor, total_memory=1 << 34),
                                "cuda", torch_version="2.11", packages=PK)


def _amd(arch):
    return info_from_properties(SimpleNamespace(name=arch, total_memory=1 << 34, gcnArchName=arch), "hip",
                                packages=PK, env={})


GPUS = {
    "hopper": _nv(9, 0),
    "ada": _nv(8, 9),
    "turing": _nv(7, 5),
    "blackwell": _nv(12, 0),
    "pascal": _nv(6, 1),
    "cdna3": _amd("gfx942"),
    "rdna3": _amd("gfx1100"),
    "rdna2": _amd("gfx1030"),
    "gfx1010": _amd("gfx1010"),
    "xpu": info_from_properties(SimpleNamespace(name="Arc", total_memory=1 << 34, has_bf16=True), "xpu"),
    "mps": GpuInfo("apple", "mps", "Apple GPU", "mps", "mps", 0, ("float16", "float32")),
    "cpu": cpu_info(),
}

INSTALLED = {
    "none": {},
    "ort-cpu": {"onnxruntime": True, "onnxruntime_gpu": False, "ort_cuda": False, "ort_migraphx": False},
    "ort-gpu": {"onnxruntime": True, "onnxruntime_gpu": True},
    "ort-cuda": {"onnxruntime": True, "onnxruntime_gpu": True, "ort_cuda": True},
    "triton": {"triton": True},
    "all": {"onnxruntime": True, "onnxruntime_gpu": True, "ort_cuda": True, "triton": True,
            "flash_attn": True},
}

# gpu, installed, preference -> backend, ONNX Runtime provider (None when not ORT), a phrase the reasons must hold
TABLE = [
    ("hopper", "none", "auto", "torch", None, "tuned for nvidia hopper"),
    ("turing", "all", "auto", "torch", None, "not chosen automatically"),
    ("blackwell", "all", "auto", "torch", None, "tuned for nvidia blackwell"),
    ("cdna3", "all", "auto", "torch", None, "tuned for amd cdna3"),
    ("hopper", "ort-cuda", "auto", "torch", None, "measured faster"),
    ("hopper", "ort-cuda", "onnxruntime", "onnxruntime", "CUDAExecutionProvider", "runs here with"),
    ("hopper", "ort-gpu", "onnxruntime", "onnxruntime", "CUDAExecutionProvider", "runs here with"),
    ("hopper", "ort-cpu", "onnxruntime", "torch", None, "pip install onnxruntime-gpu"),
    ("hopper", "none", "onnxruntime", "torch", None, "pip install onnxruntime-gpu"),
    ("hopper", "all", "torch", "torch", None, "the torch path was asked for"),
    ("cdna3", "ort-gpu", "onnxruntime", "onnxruntime", "MIGraphXExecutionProvider", "runs here with"),
    ("cdna3", "ort-cuda", "onnxruntime", "torch", None, "onnxruntime-migraphx"),
    ("rdna3", "ort-cpu", "onnxruntime", "torch", None, "CPU build"),
    ("xpu", "ort-gpu", "onnxruntime", "onnxruntime", "DmlExecutionProvider", "runs here with"),
    ("cpu", "ort-cpu", "onnxruntime", "onnxruntime", "CPUExecutionProvider", "runs here with"),
    ("cpu", "none", "onnxruntime", "torch", None, "pip install onnxruntime"),
    ("mps", "all", "onnxruntime", "torch", None, "no ONNX Runtime execution provider"),
    ("gfx1010", "all", "auto", "torch", None, "not recognised"),
    ("hopper", "all", "off", "off", None, "plain model"),
    ("cpu", "none", "off", "off", None, "plain model"),
]


@pytest.mark.parametrize("gpu,installed,pref,backend,provider,phrase", TABLE)
def test_table(gpu, installed, pref, backend, provider, phrase):
    plan = choose(GPUS[gpu], pref, INSTALLED[installed])
    assert plan.backend == backend
    assert (plan.onnxruntime.provider if plan.onnxruntime else None) == provider
    assert any(phrase in r for r in plan.reasons), plan.reasons
    assert plan.fallback == ("torch" if backend == "onnxruntime" else "off")


@pytest.mark.parametrize("gpu,installed,pref", list(itertools.product(GPUS, INSTALLED, PREFERENCES)))
def test_every_combination(gpu, installed, pref):
    g, inst = GPUS[gpu], INSTALLED[installed]
    plan = choose(g, pref, inst)
    assert plan.reasons and all(isinstance(r, str) and r for r in plan.reasons)
    assert plan.backend in ("torch", "onnxruntime", "off")
    if pref == "off":
        assert plan.backend == "off" and plan.options is None
        return
    if plan.backend == "onnxruntime":
        assert pref == "onnxruntime" and inst.get("onnxruntime") and isinstance(plan.options, OrtOptions)
    else:
        assert plan.options is plan.torch and plan.onnxruntime is None
    if pref == "onnxruntime" and plan.backend == "torch":
        assert any(f"{pref} was asked for" in r for r in plan.reasons)
    if pref == "auto":
        assert any("ONNX Runtime is not chosen automatically" in r for r in plan.reasons)
    o = plan.torch
    assert plan.dtype in g.dtypes and o.attention in g.attention and o.compile is False
    tuned = g.known and g.vendor in ("nvidia", "amd")
    assert o.cuda_graphs == tuned and o.channels_last == tuned and not o.cudnn_benchmark
    assert o.triton_kernels == (tuned and g.triton and bool(inst.get("triton")))
    assert plan.backend in plan.summary() and "\n" in plan.summary()


@pytest.mark.parametrize("gpu,dtype", [("hopper", "float16"), ("cdna3", "float16"), ("mps", "float16"),
                                       ("xpu", "float16"), ("pascal", "float16"), ("cpu", "float32")])
def test_default_dtype(gpu, dtype):
    assert choose(GPUS[gpu], "torch", {}).dtype == dtype


def test_bf16_when_asked_and_the_gpu_has_it():
    assert choose(GPUS["hopper"], "torch", {}, {"dtype": "bf16"}).dtype == "bfloat16"
    plan = choose(GPUS["turing"], "torch", {}, {"dtype": "bfloat16"})
    assert plan.dtype == "float16" and any("bfloat16 was asked for" in r for r in plan.reasons)


def test_fp32_when_the_gpu_lacks_fp16():
    maxwell = _nv(5, 0)
    plan = choose(maxwell, "torch", {})
    assert plan.dtype == "float32" and any("no float16" in r for r in plan.reasons)


def test_generic_options_off_the_tuned_gpus():
    for name in ("cpu", "mps", "xpu", "pascal", "gfx1010"):
        o = choose(GPUS[name], "auto", INSTALLED["all"]).torch
        assert not (o.cuda_graphs or o.triton_kernels or o.channels_last or o.cudnn_benchmark), name


def test_tuned_options_on_hopper():
    plan = choose(GPUS["hopper"], "torch", INSTALLED["triton"])
    assert plan.options == TorchOptions(attention="cudnn", channels_last=True, cuda_graphs=True, triton_kernels=True,
                                        cudnn_benchmark=False) and plan.dtype == "float16"
    # cuDNN's exhaustive search only when asked for (seconds at every new image size)
    assert choose(GPUS["hopper"], "torch", INSTALLED["triton"], {"cudnn_benchmark": True}).torch.cudnn_benchmark
    assert not choose(GPUS["cpu"], "torch", {}, {"cudnn_benchmark": True}).torch.cudnn_benchmark


def test_flash_attn_only_when_installed():
    ampere = info_from_properties(SimpleNamespace(name="A100", major=8, minor=0, total_memory=1 << 34), "cuda",
                                  torch_version="2.11", packages={"triton": True, "flash_attn": True})
    assert choose(ampere, "torch", {"flash_attn": True}).options.attention == "flash_attn"
    assert choose(ampere, "torch", {"flash_attn": False}).options.attention == "flash"


def test_options_override_and_pass_through():
    plan = choose(GPUS["hopper"], "torch", INSTALLED["triton"],
                  {"cuda_graphs": False, "compile": True, "attention": "efficient", "max_graphs": 2})
    o = plan.options
    assert (o.cuda_graphs, o.compile, o.attention, o.max_graphs) == (False, True, "efficient", 2)
    plan = choose(GPUS["cpu"], "torch", {}, {"cuda_graphs": True})
    assert plan.options.cuda_graphs is False and any("cuda_graphs was asked for" in r for r in plan.reasons)


def test_compile_on_a_gpu_needs_triton():
    plan = choose(GPUS["hopper"], "torch", {}, {"compile": True})
    assert plan.options.compile is False and any("pip install triton" in r for r in plan.reasons)


def test_attention_the_gpu_lacks_falls_back_with_a_reason():
    plan = choose(GPUS["turing"], "torch", {}, {"attention": "cudnn"})
    assert plan.options.attention == "efficient" and any("attention cudnn" in r for r in plan.reasons)


@pytest.mark.parametrize("options,word", [
    ({"attention": "xformers"}, "flash_attn, cudnn"),
    ({"dtype": "int8"}, "float16, bfloat16 or float32"),
    ({"cuda_graph": True, "max_graph": 2}, "did you mean 'max_graphs'.*The options are: attention, channels_last"),
    ({"cuda_graphs": "yes"}, "cuda_graphs is 'yes', not true or false"),
    ({"max_graphs": 0}, "max_graphs to a whole number of 1 or more"),
    ({"conv_algo_search": "FAST"}, "EXHAUSTIVE, HEURISTIC, DEFAULT"),
    ({"fusions": "qkv"}, "fusions to a list of names"),
])
def test_bad_options_say_what_is_valid(options, word):
    with pytest.raises(BadInput, match=word):
        choose(GPUS["hopper"], "torch", {}, options)


def test_env_var_sets_the_preference(monkeypatch):
    monkeypatch.setenv(ENV, "off")
    assert choose(GPUS["hopper"], installed={}).backend == "off"
    monkeypatch.setenv(ENV, " ONNXRuntime ")
    plan = choose(GPUS["hopper"], installed=INSTALLED["ort-cuda"])
    assert plan.backend == "onnxruntime" and any(f"{ENV}=onnxruntime" in r for r in plan.reasons)
    assert choose(GPUS["hopper"], "torch", INSTALLED["ort-cuda"]).backend == "torch"  # the argument wins
    monkeypatch.setenv(ENV, "")
    assert choose(GPUS["hopper"], installed=INSTALLED["ort-cuda"]).backend == "torch"  # empty means auto
    monkeypatch.delenv(ENV)
    assert choose(GPUS["hopper"], installed={}).backend == "torch"


def test_bad_preference_names_the_valid_values(monkeypatch):
    monkeypatch.setenv(ENV, "trt")
    with pytest.raises(BadInput) as e:
        choose(GPUS["hopper"], installed={})
    assert ENV in str(e.value) and "auto, torch, onnxruntime, off" in str(e.value)
    with pytest.raises(BadInput, match="auto, torch, onnxruntime, off"):
        choose(GPUS["hopper"], "fast", {})


def test_tensorrt_is_planned_not_offered(monkeypatch):
    monkeypatch.setenv(ENV, "tensorrt")
    with pytest.raises(BadInput, match="TensorRT path is planned, but sd-accel has none yet.*auto, torch, onnxruntime, off"):
        choose(GPUS["hopper"], installed={"tensorrt": True})


def test_summary_for_doctor():
    plan = choose(GPUS["hopper"], "onnxruntime", INSTALLED["ort-cuda"])
    text = plan.summary()
    assert text.splitlines()[0] == "backend: onnxruntime (the torch path serves any call it cannot)"
    assert "provider CUDAExecutionProvider" in text and "attention cudnn" in text
    assert all(f"- {r}" in text for r in plan.reasons)
    assert isinstance(plan, Plan) and choose(GPUS["cpu"], "off", {}).summary().startswith("backend: off")


def test_summary_says_the_plain_model_serves_what_the_torch_path_cannot():
    assert choose(GPUS["hopper"], "torch", {}).summary().splitlines()[0] == \
        "backend: torch (the plain model serves any call it cannot)"


def test_reasons_on_the_cpu_name_the_cpu_not_the_processor():
    cpu = GPUS["cpu"]
    plan = choose(cpu, "torch", {}, {"cuda_graphs": True, "attention": "flash_attn", "dtype": "bf16"})
    assert "cuda_graphs was asked for but is not available on the CPU; it stays off." in plan.reasons
    assert "attention flash_attn was asked for but cannot run on the CPU; using math." in plan.reasons
    assert "bfloat16 was asked for but the CPU cannot run it; using float32." in plan.reasons
    assert not any(f" {cpu.name};" in r or f" {cpu.name} " in r for r in plan.reasons)


def test_probe_packages_matches_this_environment():
    found = probe_packages()
    assert "tensorrt" not in found
    for name in ("onnxruntime", "triton", "flash_attn"):
        assert found[name] == (importlib.util.find_spec(name) is not None)
    if found["onnxruntime"]:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        assert all(found[k] == (p in providers) for k, p in ORT_PROVIDERS.items())
    assert found["onnxruntime_gpu"] == any(found[k] for k in ORT_PROVIDERS)
    # the default probe is what choose() uses when `installed` is not given
    assert choose(cpu_info(), "onnxruntime").backend == ("onnxruntime" if found["onnxruntime"] else "torch")
