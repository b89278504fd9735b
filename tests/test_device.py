"""GPU detection from faked device properties: every family, unknown architectures, broken properties."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from sd_accel.accel.plan import device
from sd_accel.accel.plan.device import amd_arch, describe, detect, info_from_properties

GiB = 2**30
WITH_TRITON = {"triton": True, "flash_attn": False}


def nv(name, major, minor):
    return SimpleNamespace(name=name, major=major, minor=minor, total_memory=24 * GiB, multi_processor_count=80)


def amd(name, arch):
    # ROCm reports a compute capability too (gfx942 -> 9.4); detection must go by gcnArchName.
    return SimpleNamespace(name=name, major=9, minor=4, total_memory=64 * GiB, gcnArchName=arch)


# props, backend -> vendor, family, arch, known, bf16, first attention kernel, triton
CASES = [
    (nv("NVIDIA GeForce RTX 2080 Ti", 7, 5), "cuda", "nvidia", "turing", "sm_75", True, False, "efficient", True),
    (nv("NVIDIA A100-SXM4-80GB", 8, 0), "cuda", "nvidia", "ampere", "sm_80", True, True, "flash", True),
    (nv("NVIDIA GeForce RTX 3090", 8, 6), "cuda", "nvidia", "ampere", "sm_86", True, True, "flash", True),
    (nv("Orin", 8, 7), "cuda", "nvidia", "ampere", "sm_87", True, True, "flash", True),
    (nv("NVIDIA GeForce RTX 4090", 8, 9), "cuda", "nvidia", "ada", "sm_89", True, True, "flash", True),
    (nv("NVIDIA H100 80GB HBM3", 9, 0), "cuda", "nvidia", "hopper", "sm_90", True, True, "cudnn", True),
    (nv("NVIDIA B200", 10, 0), "cuda", "nvidia", "blackwell", "sm_100", True, True, "cudnn", True),
    (nv("NVIDIA GeForce RTX 5090", 12, 0), "cuda", "nvidia", "blackwell", "sm_120", True, True, "cudnn", True),
    (nv("NVIDIA GeForce GTX 1080", 6, 1), "cuda", "nvidia", "unknown", "sm_61", False, False, "efficient", False),
    (nv("Tesla V100", 7, 0), "cuda", "nvidia", "unknown", "sm_70", False, False, "efficient", False),
    (nv("future", 15, 0), "cuda", "nvidia", "unknown", "sm_150", False, True, "efficient", False),
    (amd("AMD Radeon RX 6800 XT", "gfx1030"), "hip", "amd", "rdna2", "gfx1030", True, False, "math", False),
    (amd("AMD Radeon RX 7900 XTX", "gfx1100"), "hip", "amd", "rdna3", "gfx1100", True, True, "math", True),
    (amd("AMD Radeon RX 7800 XT", "gfx1101"), "hip", "amd", "rdna3", "gfx1101", True, True, "math", True),
    (amd("AMD Radeon 890M", "gfx1150"), "hip", "amd", "rdna3", "gfx1150", True, True, "math", True),
    (amd("AMD Ryzen AI Max+ 395", "gfx1151"), "hip", "amd", "rdna3", "gfx1151", True, True, "math", True),
    (amd("AMD Radeon RX 9070 XT", "gfx1201"), "hip", "amd", "rdna4", "gfx1201", True, True, "math", True),
    (amd("AMD Instinct MI100", "gfx908:sramecc+:xnack-"), "hip", "amd", "cdna1", "gfx908", True, True, "math", True),
    (amd("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-"), "hip", "amd", "cdna2", "gfx90a", True, True, "flash", True),
    (amd("AMD Instinct MI300X", "gfx942:sramecc+:xnack-"), "hip", "amd", "cdna3", "gfx942", True, True, "flash", True),
    (amd("AMD Instinct MI355X", "gfx950"), "hip", "amd", "cdna3", "gfx950", True, True, "flash", True),
    (amd("AMD Radeon RX 5700 XT", "gfx1010"), "hip", "amd", "unknown", "gfx1010", False, False, "math", False),
    (SimpleNamespace(name="Intel(R) Arc(TM) A770 Graphics", total_memory=16 * GiB, has_fp16=True, has_bf16=True),
     "xpu", "intel", "xpu", "xpu", True, True, "math", False),
]


@pytest.mark.parametrize("props,backend,vendor,family,arch,known,bf16,first,triton", CASES,
                         ids=[c[0].name for c in CASES])
def test_families(props, backend, vendor, family, arch, known, bf16, first, triton):
    g = info_from_properties(props, backend, index=1, torch_version="2.11.0+cu130", packages=WITH_TRITON, env={})
    assert (g.vendor, g.family, g.arch, g.known) == (vendor, family, arch, known)
    assert ("bfloat16" in g.dtypes) == bf16
    assert "float16" in g.dtypes and "float32" in g.dtypes  # fp16 on every GPU, fp32 always
    assert g.attention[0] == first and g.attention[-1] == "math"
    assert set(g.attention) <= {"flash_attn", "cudnn", "flash", "efficient", "math"}
    assert g.triton == triton
    assert g.graphs == (vendor in ("nvidia", "amd"))
    assert g.device == ("xpu:1" if backend == "xpu" else "cuda:1")
    assert g.vram_bytes == props.total_memory and g.name == props.name
    assert bool(g.notes) == (not known or family in ("rdna3", "rdna4", "xpu"))


def test_unknown_architectures_say_so_in_words():
    old = info_from_properties(nv("GTX 1080", 6, 1), "cuda", packages=WITH_TRITON, torch_version="2.11")
    new = info_from_properties(nv("future", 15, 0), "cuda", packages=WITH_TRITON, torch_version="2.11")
    gfx = info_from_properties(amd("RX 5700", "gfx1010:xnack-"), "hip", packages=WITH_TRITON, env={})
    assert "6.1 is older" in old.notes[0] and "generic" in old.notes[0]
    assert "15.0 is newer" in new.notes[0]
    assert "gfx1010" in gfx.notes[0] and "generic" in gfx.notes[0]


class _Broken:
    name = "broken"

    def __getattr__(self, item):
        raise RuntimeError("HIP error: invalid device ordinal")


@pytest.mark.parametrize("backend", ["cuda", "hip", "xpu", "vulkan"])
def test_broken_properties_never_raise(backend):
    g = info_from_properties(_Broken(), backend, packages=WITH_TRITON, env={})
    assert (g.vendor, g.family, g.known) == ("unknown", "unknown", False)
    assert g.notes and "generic torch path" in g.notes[0]
    assert not g.graphs and not g.triton and g.attention == ("math",)


def test_flash_attn_package_only_where_it_runs():
    pk = {"triton": True, "flash_attn": True}
    get = lambda p, b: info_from_properties(p, b, torch_version="2.11", packages=pk, env={}).attention
    assert get(nv("A100", 8, 0), "cuda")[0] == "flash_attn"
    assert get(nv("H100", 9, 0), "cuda")[:2] == ("cudnn", "flash_attn")
    assert "flash_attn" not in get(nv("T4", 7, 5), "cuda")
    assert get(amd("MI300X", "gfx942"), "hip")[0] == "flash_attn"
    assert "flash_attn" not in get(amd("RX 7900", "gfx1100"), "hip")


def test_cudnn_attention_needs_torch_2_5():
    h100 = nv("H100", 9, 0)
    assert info_from_properties(h100, "cuda", torch_version="2.4.1", packages=WITH_TRITON).attention[0] == "flash"
    assert info_from_properties(h100, "cuda", torch_version="2.5.0", packages=WITH_TRITON).attention[0] == "cudnn"


def test_triton_needs_the_package():
    g = info_from_properties(nv("H100", 9, 0), "cuda", torch_version="2.11", packages={"triton": False})
    assert not g.triton and g.graphs


@pytest.mark.parametrize("arch", ["gfx1100", "gfx1201"])
def test_rdna_flash_attention_is_experimental(arch):
    off = info_from_properties(amd("RX", arch), "hip", packages=WITH_TRITON, env={})
    on = info_from_properties(amd("RX", arch), "hip", packages=WITH_TRITON,
                              env={"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1"})
    assert off.attention == ("math",) and "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1" in off.notes[0]
    assert on.attention == ("flash", "efficient", "math") and "experimental" in on.notes[0]


def test_fp16_only_on_gpus_that_have_it():
    g = info_from_properties(nv("GTX 750 Ti", 5, 0), "cuda", packages=WITH_TRITON, torch_version="2.11")
    assert g.dtypes == ("float32",)


@pytest.mark.parametrize("raw,arch", [("gfx90a:sramecc+:xnack-", "gfx90a"), ("gfx1100", "gfx1100"), (" GFX942:xnack+", "gfx942")])
def test_amd_arch_strips_features(raw, arch):
    assert amd_arch(raw) == arch


def test_detect_on_this_machine_is_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    g = detect()
    assert (g.vendor, g.family, g.device, g.dtypes) == ("cpu", "cpu", "cpu", ("float32",))
    # Triton runs on the CPU only in its interpreter (TRITON_INTERPRET=1, as the tests set it without a GPU)
    assert not g.graphs and g.triton == (os.environ.get("TRITON_INTERPRET") == "1")
    assert "CPU" in describe(g) and "\n" not in describe(g)


def test_detect_reads_cuda_properties(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: nv(f"H100 #{i}", 9, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    g = detect(1)
    assert (g.vendor, g.family, g.device, g.name) == ("nvidia", "hopper", "cuda:1", "H100 #1")
    assert g.driver.startswith("cuda 13.0")
    missing = detect(5)
    assert missing.vendor == "unknown" and "there is no GPU 5" in missing.notes[0]


def test_detect_reads_rocm_properties(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: amd("MI300X", "gfx942:sramecc+:xnack-"))
    monkeypatch.setattr(torch.version, "hip", "7.0.1")
    g = detect()
    assert (g.vendor, g.family, g.arch) == ("amd", "cdna3", "gfx942") and g.driver.startswith("hip 7.0.1")


def test_detect_never_raises(monkeypatch):
    def boom(i):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", boom)
    g = detect()
    assert g.vendor == "unknown" and not g.known and "CUDA driver initialization failed" in g.notes[0]


def test_describe_is_one_line_with_the_essentials():
    g = info_from_properties(nv("NVIDIA H100 80GB HBM3", 9, 0), "cuda", torch_version="2.11",
                             packages=WITH_TRITON, driver="cuda 13.0")
    line = describe(g)
    assert "\n" not in line
    for part in ("NVIDIA H100 80GB HBM3", "hopper", "sm_90", "24.0 GiB", "fp16/bf16/fp32", "cudnn>flash", "cuda 13.0"):
        assert part in line
    unknown = describe(info_from_properties(nv("GTX 1080", 6, 1), "cuda", torch_version="2.11", packages=WITH_TRITON))
    assert "unrecognised" in unknown


def test_tables_are_consistent():
    families = set(device.NVIDIA_FAMILIES.values()) | set(device.AMD_FAMILIES.values())
    assert families == set(device.FAMILY_TRAITS)
