"""The C++ kernels' build key: one build per source, flags, torch version and CPU instruction set, so
that a cache moved to a CPU without the instructions `-march=native` chose builds afresh."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import cpp_build
from pagoda.cpp_build import build_key, cpu_flags

ZEN4 = "avx avx2 avx512_bf16 avx512bw avx512f fma sse4_2"
HASWELL = "avx avx2 fma sse4_2"


def test_the_key_follows_the_cpu_flags(monkeypatch, tmp_path: Path):
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: ZEN4)
    zen4 = build_key(source)
    assert build_key(source) == zen4  # the same flags: the same build
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: HASWELL)
    assert build_key(source) != zen4  # no AVX-512: another build
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: ZEN4)
    assert build_key(source) == zen4


def test_the_key_follows_the_source_its_headers_and_the_flags(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: ZEN4)
    header, source = tmp_path / "h.h", tmp_path / "k.cpp"
    header.write_text("#pragma once\nconstexpr int kOne = 1;\n")
    source.write_text('#include "h.h"\n#include <vector>\nint f() { return kOne; }\n')
    assert cpp_build._included_headers(source) == [header.resolve()]
    first = build_key(source)
    header.write_text("#pragma once\nconstexpr int kOne = 2;\n")
    second = build_key(source)
    assert second != first  # a header's change rebuilds
    monkeypatch.setattr(cpp_build, "CFLAGS", (*cpp_build.CFLAGS, "-ffast-math"))
    assert build_key(source) != second


def test_cpu_flags_are_read_once_and_name_the_simd_sets():
    flags = cpu_flags()
    assert cpu_flags() is flags  # cached: read once per process
    if Path("/proc/cpuinfo").exists() and cpp_build.platform.machine() in ("x86_64", "AMD64"):
        assert "sse2" in flags.split()
        assert flags.split() == sorted(set(flags.split()))


def test_the_kernels_are_built_under_their_key():
    from pagoda.model.cpu_layer_ops import _SOURCE, load_layer_ops

    module = load_layer_ops()
    if module is None:
        pytest.skip("the C++ layer ops did not build (PAGODA_NO_CPP=1 or no compiler)")
    assert module.__name__ == f"pagoda_layer_ops_{build_key(_SOURCE)}"


def test_dtype_auto_reads_the_same_cpu_flags(monkeypatch):
    """`dtype=auto`'s bf16 test and the build key read one list of flags (cpp_build.cpu_flags)."""
    from pagoda.model import loader

    monkeypatch.setattr(loader, "cpu_flags", lambda: ZEN4)
    assert loader.cpu_has_bf16()
    monkeypatch.setattr(loader, "cpu_flags", lambda: HASWELL + " amx_tile")
    assert not loader.cpu_has_bf16()
    monkeypatch.setattr(loader, "cpu_flags", lambda: HASWELL + " amx_bf16")
    assert loader.cpu_has_bf16()


def test_an_avx2_level_builds_and_chooses_as_an_avx2_cpu(monkeypatch, tmp_path: Path):
    """PAGODA_CPU_ISA=avx2: the kernels compile for x86-64-v3, the flags an AVX2-only CPU lacks are
    hidden (so `dtype=auto` picks float32), and the build is another one than the native build."""
    from pagoda.model import loader

    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(cpp_build, "_own_flags", lambda: ZEN4 + " avx512_vnni amx_bf16 avx_vnni")
    monkeypatch.delenv("PAGODA_CPU_ISA", raising=False)
    native = build_key(source)
    assert "-march=native" in cpp_build.cflags()
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    assert "-march=x86-64-v3" in cpp_build.cflags() and "-march=native" not in cpp_build.cflags()
    assert "-DPAGODA_CPU_LEVEL_AVX2" in cpp_build.cflags()  # what quant_matmul.cpp's choice reads
    monkeypatch.setenv("PAGODA_CPU_ISA", " AVX2 ")  # as cpu_isa reads it: the same level
    assert "-DPAGODA_CPU_LEVEL_AVX2" in cpp_build.cflags()
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    assert cpu_flags().split() == ["avx", "avx2", "fma", "sse4_2"]
    assert not loader.cpu_has_bf16()
    assert build_key(source) != native
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="PAGODA_CPU_ISA must be native or one of"):
        cpu_flags()

