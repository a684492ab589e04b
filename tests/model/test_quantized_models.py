"""Models run with their weights kept quantized (`--quantization gguf | int8`), end to end through
the engine: greedy output and logprobs against the same weights dequantized, the packed bytes held,
and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pagoda import SamplingParams
from pagoda.config import EngineArgs
from pagoda.exec.quant_linear import Int8Rows, load_quant_kernels, w8a8_gemm, w8a8_kernel
from pagoda.model.errors import ModelLoadError
from pagoda.model.loader import load_model
from pagoda.model.quantized import QuantEmbedding, QuantLinear, quantize_int8, quantized_bytes
from tests.conftest import make_engine
from tests.model.test_gguf_and_errors import write_tiny_gguf
from tests.tiny_models import save_tiny_model

gguf = pytest.importorskip("gguf")

PROMPTS = [[5, 17, 99, 3], [200, 201, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [42]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def _run(loaded, **kwargs):
    llm = make_engine(loaded, num_gpu_blocks_override=64, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _assert_same_output(got, want, atol: float) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=atol)


def _write_k_quant_gguf(hf_model, path, qtype_name: str) -> None:
    """gguf-py cannot quantize the K types: their 2-D tensors are random valid blocks instead."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    original = gguf.quants.quantize

    def random_blocks(array, kind):
        if kind != qtype:
            return original(array, kind)
        rows, cols = array.shape
        raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
        scale = (np.abs(rng.standard_normal((rows, cols // block, 2))) * 2e-4).astype(np.float16).view(np.uint8)
        if qtype_name == "Q6_K":
            raw[:, :, 208:210] = scale[:, :, :2]
        else:
            raw[:, :, 0:4] = scale
        return raw.reshape(rows, -1)

    gguf.quants.quantize = random_blocks
    try:
        write_tiny_gguf(hf_model, path, qtype_name)
    finally:
        gguf.quants.quantize = original


@pytest.fixture
def float_kernels(monkeypatch):
    """The float few-rows path and no W8A8 GEMM, for the tests that hold packed weights to the
    dequantized model within float32 rounding: the default integer paths round activations to int8
    (their bounds are tested in tests/exec/test_quant_dot.py and test_cpu_gemm_int8.py; end to end
    below and on SmolLM2)."""
    monkeypatch.setenv("PAGODA_NO_W8A8", "1")
    ops = load_quant_kernels()
    ops.set_isa("auto")
    ops.set_isa({"avx512_vnni": "avx512", "avx2_int8": "avx2"}.get(ops.isa(), ops.isa()))
    yield
    ops.set_isa("auto")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    # 256 wide: the K types' blocks hold 256 weights.
    folder = tmp_path_factory.mktemp("tiny_quant")
    hf = save_tiny_model("llama_linear", folder, hidden_size=256, intermediate_size=512, head_dim=64)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return folder, hf


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_packed_gguf_equals_the_dequantized_model(tmp_path, tiny_hf, qtype, float_kernels):
    _, hf = tiny_hf
    path = tmp_path / f"tiny-{qtype}.gguf"
    (_write_k_quant_gguf if qtype.endswith("_K") else write_tiny_gguf)(hf, path, qtype)
    packed = load_model(str(path), dtype="float32", quantization="gguf")
    net = packed.model
    assert not [n for n, m in net.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    assert isinstance(net.model.embed_tokens, QuantEmbedding) and isinstance(net.lm_head, QuantLinear)
    # Resident weights: the file's blocks, once (the tied head shares the embedding's).
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)
    assert quantized_bytes(net) == file_bytes
    want = _run(load_model(str(path), dtype="float32"))
    _assert_same_output(_run(packed), want, atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_integer_dots_stay_close_to_the_dequantized_model(tmp_path, tiny_hf, qtype):
    """The default few-rows path (activations rounded to int8, integer dot products): a random tiny
    model parts from the dequantized one at near-ties after a few tokens, so what is held is the
    first token's logprob (measured within 0.015; bound 0.05, as int8 weights' bound below); on the
    real SmolLM2 the greedy tokens equal transformers' (test_smollm2_q4_1_kept_packed_...)."""
    _, hf = tiny_hf
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(hf, path, qtype)
    ops = load_quant_kernels()
    ops.set_isa("auto")
    assert ops.isa() in ("avx512_vnni", "avx2_int8") or ops.isa() == "scalar"
    got = _run(load_model(str(path), dtype="float32", quantization="gguf"))
    want = _run(load_model(str(path), dtype="float32"))
    assert all(g[0][0] == w[0][0] for g, w in zip(got, want))
    assert max(abs(g[1][0] - w[1][0]) for g, w in zip(got, want)) < 0.05


def test_int8_weight_only_runs_any_model_close_to_float(tmp_path, float_kernels):
    folder = tmp_path / "llama3"
    save_tiny_model("llama3", folder)  # untied head: stays in float
    quant = load_model(str(folder), dtype="float32", quantization="int8")
    linears = [m for m in quant.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4 and all(m.parts[0].qtype == "int8" for m in linears)
    assert type(quant.model.lm_head) is nn.Linear
    # A byte per weight and a float32 scale per output channel, instead of four bytes per weight.
    assert quantized_bytes(quant.model) == sum(m.out_features * (m.in_features + 4) for m in linears)
    got = _run(quant)
    # The float model with the same int8-rounded weights: equal within float32 rounding.
    rounded = load_model(str(folder), dtype="float32")
    with torch.no_grad():
        for name, m in rounded.model.named_modules():
            if type(m) is nn.Linear and not name.endswith("lm_head"):
                m.weight.copy_(quantize_int8(m.weight).dequantize())
    _assert_same_output(got, _run(rounded), atol=1e-4)
    # Against the original weights: int8 moves each by at most half its row's step, so the first
    # token's logprob is close (later tokens of a random model may part at near-ties).
    want = _run(load_model(str(folder), dtype="float32"))
    assert max(abs(g[1][0] - w[1][0]) for g, w in zip(got, want)) < 0.1


@pytest.mark.skipif(w8a8_kernel() is None, reason="the CPU has no AVX512-VNNI (the W8A8 GEMM is not used)")
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_int8_through_the_w8a8_gemm_equals_the_few_rows_path(tmp_path, monkeypatch, dtype, atol):
    """The default int8 path: a prompt's rows (22 in the first step) through the W8A8 GEMM give what
    the few-rows integer path (PAGODA_NO_W8A8=1, the prompts fed 8 tokens a step) gives, the
    activations being rounded to int8 alike; the first token is the rounded float model's."""
    folder = tmp_path / "llama3"
    save_tiny_model("llama3", folder)
    quant = load_model(str(folder), dtype=dtype, quantization="int8")
    got = _run(quant)
    linears = [m for m in quant.model.modules() if isinstance(m, QuantLinear)]
    assert all(isinstance(m.kernel, Int8Rows) and m.kernel.gemm is w8a8_gemm for m in linears)
    monkeypatch.setenv("PAGODA_NO_W8A8", "1")
    _assert_same_output(got, _run(load_model(str(folder), dtype=dtype, quantization="int8"), max_num_batched_tokens=8),
                        atol=atol)
    rounded = load_model(str(folder), dtype=dtype)
    with torch.no_grad():
        for name, m in rounded.model.named_modules():
            if type(m) is nn.Linear and not name.endswith("lm_head"):
                m.weight.copy_(quantize_int8(m.weight).dequantize())
    assert all(g[0][0] == w[0][0] for g, w in zip(got, _run(rounded)))


def test_int8_on_a_gguf_and_in_bfloat16(tmp_path, tiny_hf):
    _, hf = tiny_hf
    path = tmp_path / "tiny-Q8_0.gguf"
    write_tiny_gguf(hf, path, "Q8_0")
    # bf16 activations over packed weights: the dequantized bf16 model's output, within bf16's
    # rounding (the fused kernel accumulates in float32 where the bf16 GEMM rounds its inputs).
    want = _run(load_model(str(path), dtype="bfloat16"))
    for quantization in ("int8", "gguf"):
        quant = load_model(str(path), dtype="bfloat16", quantization=quantization)
        assert any(isinstance(m, QuantLinear) for m in quant.model.modules())
        got = _run(quant)
        assert all(len(tokens) == 12 for tokens, _ in got)
        if quantization == "gguf":
            assert max(abs(g[1][0] - w[1][0]) for g, w in zip(got, want)) < 0.05


def test_quantizations_that_do_not_fit_are_refused_in_one_line(tmp_path, tiny_hf):
    folder, hf = tiny_hf
    with pytest.raises(ModelLoadError, match=r"^quantization fp8 needs a CUDA GPU \(e4m3 weights\); the device is cpu$"):
        load_model(str(folder), dtype="float32", quantization="fp8")
    with pytest.raises(ModelLoadError, match="quantization gguf needs a .gguf model"):
        load_model(str(folder), dtype="float32", quantization="gguf")
    path = tmp_path / "tiny-Q5_0.gguf"
    write_tiny_gguf(hf, path, "Q5_0")
    with pytest.raises(ModelLoadError, match=r"has GGUF type Q5_0, which --quantization gguf cannot run quantized "
                                             r"\(supported: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K\)"):
        load_model(str(path), dtype="float32", quantization="gguf")
    assert load_model(str(path), dtype="float32").model is not None  # without it: dequantized, as before
    with pytest.raises(ValueError, match="quantization must be one of gguf, int8, fp8; got 'awq'"):
        EngineArgs(quantization="awq")
    # The device rules alone (no GPU needed): fp8 takes a folder of float weights on CUDA, every
    # quantization runs on the CPU or CUDA.
    from pagoda.model.quant_loader import check_quantization

    cuda = torch.device("cuda")
    with pytest.raises(ModelLoadError, match=r"^quantization fp8 needs a Hugging Face folder of float weights; "
                                             r"a \.gguf keeps its own blocks with --quantization gguf$"):
        check_quantization("fp8", cuda, source_is_gguf=True)
    for quantization, gguf_source in (("fp8", False), ("int8", False), ("gguf", True), ("int8", True)):
        check_quantization(quantization, cuda, gguf_source)
    with pytest.raises(ModelLoadError, match=r"^quantization int8 runs on the CPU or a CUDA GPU; the device is mps$"):
        check_quantization("int8", torch.device("mps"), False)
    with pytest.raises(ValueError, match="runs on one rank in this process only"):
        EngineArgs(quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="runs on one rank in this process only"):
        EngineArgs(quantization="gguf", distributed_executor_backend="mp")


@pytest.mark.slow
def test_smollm2_q4_1_kept_packed_equals_transformers(smollm2_hf_greedy32, smollm2_prompt_ids, smollm2_source):
    """SmolLM2's Q4_1 GGUF run from its blocks: transformers' greedy output on the same file (which
    it dequantizes to float32) for all 16 test prompts, in a fraction of the memory."""
    packed = load_model(None, dtype="float32", quantization="gguf")
    assert quantized_bytes(packed.model) <= smollm2_source.path.stat().st_size
    params = sum(p.numel() * p.element_size() for p in packed.model.parameters())
    assert params < 1_000_000  # only the norms are float
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def run(loaded):
        llm = make_engine(loaded, num_gpu_blocks_override=512)
        outs = llm.generate([{"prompt_token_ids": p} for p in smollm2_prompt_ids], greedy, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert run(packed) == smollm2_hf_greedy32


@pytest.mark.slow
def test_smollm2_q4_1_integer_dots_follow_transformers(smollm2_hf_greedy32, smollm2_prompt_ids, hf_smollm2,
                                                       monkeypatch):
    """The same in decode steps of at most 8 rows, so that every decode linear takes the default
    integer path (activations rounded to int8 per 32-block, integer dot products, as llama.cpp
    computes): transformers' 32 greedy tokens, except where the int8 rounding flips a near-tie (the
    rule of test_smollm2_reference.py: fp32's top-2 margin below 0.25 at the first differing token).
    Measured on the AVX512-VNNI EPYC: 9 of the 16 prompts leave transformers at some token between
    the 4th and the 28th, at fp32 margins 0.005-0.153. The kernels' calls are
    counted to show which path ran."""
    from pagoda.exec import quant_linear
    from tests.model.test_smollm2_reference import near_tie_differences

    fused_rows: list[int] = []
    real = quant_linear.load_quant_kernels()
    real.set_isa("auto")
    assert real.isa() in ("avx512_vnni", "avx2_int8"), "this CPU runs no integer path"

    class Counted:
        def __getattr__(self, name):
            return getattr(real, name)

        def quant_matmul(self, x, *args):
            fused_rows.append(x.shape[0])
            return real.quant_matmul(x, *args)

    monkeypatch.setattr(quant_linear, "load_quant_kernels", Counted)
    # The modules' path, whose kernel calls go through Python and can be counted; the fused decode
    # step calls the same kernel from C++ and gives the same bits (tests/exec/test_fused_decode.py).
    monkeypatch.setenv("PAGODA_NO_FUSED_DECODE", "1")
    packed = load_model(None, dtype="float32", quantization="gguf")
    llm = make_engine(packed, num_gpu_blocks_override=512, max_num_seqs=8)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in smollm2_prompt_ids], greedy, use_tqdm=False)
    differ = near_tie_differences(hf_smollm2, smollm2_prompt_ids, outs, smollm2_hf_greedy32, "integer dots")
    print("near-ties flipped (prompt: (token, margin)):", differ)
    assert len(differ) <= 12, f"near-ties (prompt: (token, margin)) {differ}"
    # 16 prompts x 31 decode steps, 8 at a time, each through SmolLM2's 121 packed linears (q/k/v and
    # gate/up fused: 4 x 30, and the head).
    assert fused_rows and max(fused_rows) <= 8 and len(fused_rows) >= 2 * 31 * 121


def _rewrite_split(src, dst_first, max_tensors: int) -> list:
    """`src` rewritten as a split GGUF (gguf-py's writer names the parts name-0000i-of-0000n.gguf)."""
    reader = gguf.GGUFReader(str(src))
    stem = dst_first.name.replace("-00001-of-", "-").rsplit("-", 1)[0]
    writer = gguf.GGUFWriter(str(dst_first.with_name(f"{stem}.gguf")), arch="llama", split_max_tensors=max_tensors)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type.name == "F32":
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(dst_first.parent.glob(f"{stem}-0000*-of-*.gguf"))


def test_split_gguf_sets_load_as_one_file(tmp_path, tiny_hf, float_kernels):
    _, hf = tiny_hf
    single = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(hf, single, "Q4_1")
    (tmp_path / "split").mkdir()
    parts = _rewrite_split(single, tmp_path / "split" / "tiny-00001-of-00003.gguf", max_tensors=9)
    assert [p.name for p in parts] == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf", "tiny-00003-of-00003.gguf"]
    want = _run(load_model(str(single), dtype="float32"))
    _assert_same_output(_run(load_model(str(parts[0]), dtype="float32")), want, atol=1e-6)
    packed = load_model(str(parts[0]), dtype="float32", quantization="gguf")
    _assert_same_output(_run(packed), want, atol=1e-4)
    with pytest.raises(ModelLoadError, match=r"part 2 of a split GGUF; give its first part, tiny-00001-of-00003\.gguf"):
        load_model(str(parts[1]), dtype="float32")
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match=r"split GGUF of 3 parts lacks tiny-00003-of-00003\.gguf"):
        load_model(str(parts[0]), dtype="float32")


def test_light_gguf_index_reads_what_gguf_py_reads(smollm2_source):
    """The index the packed load reads (gguf_index) against gguf-py's reader, on the real file."""
    from pagoda.model.gguf_index import GGUFIndex, SkippedStrings

    path = smollm2_source.path
    full, light = gguf.GGUFReader(str(path)), GGUFIndex(path)
    assert set(light.fields) == set(full.fields) - {k for k in full.fields if k.startswith("GGUF.")}
    for key, field in light.fields.items():
        want = full.fields[key].contents()
        if isinstance(field.contents(), SkippedStrings):
            assert len(field.contents()) == len(want) and isinstance(want[0], str)
        else:
            assert field.contents() == want, key
    assert len(light.tensors) == len(full.tensors)
    for a, b in zip(light.tensors, full.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_bytes) == (b.name, b.tensor_type, b.shape.tolist(), int(b.n_bytes))
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data[:2], b.data[:2]) and np.array_equal(a.data[-1:], b.data[-1:])
