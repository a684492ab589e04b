"""The fused CPU decode step (exec/fused_decode.py) gives the module path's output bit for bit, for
every kind of linear it serves, is used for exactly the pure-decode steps and the steps of one prompt
with no cached prefix (of up to QUANT_MAX_ROWS rows with quantized weights),
follows weights replaced under it (a weight update, sleep and wake), serves MoE layers whose experts
run on the grouped bf16 kernel or are kept quantized, and stands aside for the models it does not serve."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagoda import SamplingParams
from pagoda.exec import cpu_linear, fused_decode, quant_linear
from pagoda.exec.cpu_grouped_moe import grouped_kernel
from pagoda.exec.cpu_linear import gemm_kernel
from pagoda.exec.fused_decode import QUANT_MAX_ROWS, FusedCPUDecoder
from pagoda.model.loader import load_model
from tests.conftest import make_engine
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(fused_decode.load_fused_decode() is None, reason="the C++ extensions do not build here")

# Nineteen requests of different lengths: decode steps of 19 rows down to one (17 and 19 rows are
# padded for oneDNN; with quantized weights the steps above QUANT_MAX_ROWS take the modules), and
# mixed steps as they come in (the modules).
PROMPTS = [[5 + i, 17, 99, 3 + i][: 1 + i % 4] for i in range(19)]
# Prompts alone, with no cached prefix: their steps are fused too (their prompt logprobs read every
# row), but with quantized weights the one beyond QUANT_MAX_ROWS.
LONE_PROMPTS = [[(7 * i) % 50 + 1 for i in range(37)], [11, 3, 42, 8, 29]]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=3)


def _outputs(loaded, monkeypatch, fused: bool, **engine_args):
    monkeypatch.setenv("PAGODA_NO_FUSED_DECODE", "0" if fused else "1")
    llm = make_engine(loaded, num_gpu_blocks_override=128, **engine_args)
    runner = llm.engine.core.runner
    assert (runner.fused_decode is not None) == fused
    rows: list[tuple[int, bool]] = []  # (rows, whether a prompt's step) of each fused step
    if fused:
        run = runner.fused_decode.run

        def counting(input_ids, positions, meta):
            rows.append((input_ids.shape[0], meta.num_decodes == 0))
            return run(input_ids, positions, meta)

        runner.fused_decode.run = counting
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:1]], _params(3), use_tqdm=False)
    many = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [_params(i) for i in range(len(PROMPTS))],
                        use_tqdm=False)
    lone_params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    lone = [o for p in LONE_PROMPTS for o in llm.generate([{"prompt_token_ids": p}], lone_params, use_tqdm=False)]
    out = [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in first + many + lone]
    out += [[sorted(lp.items()) for lp in o.prompt_logprobs[1:]] for o in lone]
    return out, rows, llm


def skip_bf16_without_packed_linears(dtype: str) -> None:
    """The fused step calls packed linears; bf16 ones are packed only with native bf16 (an AVX2-only
    CPU runs a bf16 model's linears through torch, and its steps through the modules)."""
    if dtype == "bfloat16" and not cpu_linear._native_bf16():
        pytest.skip("bf16 linears are packed only on CPUs with native bf16 (AVX512-BF16 or AMX)")


def _assert_fused_equals_modules(loaded_fn, monkeypatch, quantized: bool = False, **engine_args):
    want, _, _ = _outputs(loaded_fn(), monkeypatch, fused=False, **engine_args)
    got, rows, llm = _outputs(loaded_fn(), monkeypatch, fused=True, **engine_args)
    assert got == want  # tokens, logprobs and prompt logprobs, bit for bit
    # Every decode step took the fused one, but those beyond QUANT_MAX_ROWS with quantized weights;
    # so did the prompts that had a step to themselves (a one-token prompt's step counts as a decode).
    assert {n for n, prompt in rows if not prompt} == set(range(1, (QUANT_MAX_ROWS if quantized else len(PROMPTS)) + 1))
    lone = {len(p) for p in LONE_PROMPTS}
    assert {n for n, prompt in rows if prompt} == ({n for n in lone if n <= QUANT_MAX_ROWS} if quantized else lone)
    return llm


@pytest.mark.parametrize("arch,dtype", [("llama3", "float32"), ("llama3", "bfloat16"), ("qwen2", "bfloat16"),
                                        ("mistral", "float32"), ("qwen3", "float32"), ("qwen3", "bfloat16"),
                                        ("mixtral", "bfloat16"), ("qwen3_moe", "bfloat16")])
def test_fused_step_equals_the_modules(tmp_path, monkeypatch, arch, dtype):
    # qwen2: a QKV bias; qwen3: per-head q/k norms; mixtral: routed experts in every layer (in bf16 on
    # the grouped kernel), qwen3_moe: in layers 1 and 2 and a dense MLP in layer 0
    if arch in ("mixtral", "qwen3_moe") and grouped_kernel() is None:
        pytest.skip("MoE layers are served on the grouped kernel, which needs AVX512-BF16")
    skip_bf16_without_packed_linears(dtype)
    save_tiny_model(arch, tmp_path)
    _assert_fused_equals_modules(lambda: load_model(str(tmp_path), dtype=dtype, device="cpu"), monkeypatch)


@pytest.mark.parametrize("amx", [False, True])
def test_fused_bf16_step_equals_the_modules_on_either_gemm(tmp_path, monkeypatch, amx):
    # Which GEMM a bf16 linear takes follows the CPU (cpu_linear.gemm_applies: oneDNN where it has AMX,
    # else our GEMM): both here, whichever this CPU is.
    skip_bf16_without_packed_linears("bfloat16")
    if not amx and gemm_kernel() is None:
        pytest.skip("the bf16 GEMM needs AVX512-BF16")
    monkeypatch.setattr(cpu_linear, "cpu_has_amx", lambda: amx)
    save_tiny_model("llama3", tmp_path)
    loaded = lambda: load_model(str(tmp_path), dtype="bfloat16", device="cpu")  # noqa: E731
    llm = _assert_fused_equals_modules(loaded, monkeypatch)
    linears = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert linears and all(m.gemm is not amx for m in linears)


def test_fused_step_equals_the_modules_with_quantized_weights(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from tests.model.test_gguf_and_errors import write_tiny_gguf

    hf = save_tiny_model("llama_linear", tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(hf, path, "Q4_1")
    _assert_fused_equals_modules(lambda: load_model(str(path), dtype="float32", quantization="gguf"), monkeypatch,
                                 quantized=True)

    def int8(dtype: str = "bfloat16"):
        return lambda: load_model(str(tmp_path / "hf"), dtype=dtype, quantization="int8")

    # int8 with AVX512-VNNI: rows kept beside the W8A8 GEMM's order, or where memory is short the
    # W8A8 order alone, every row count fused (float32 and bf16).
    if quant_linear.w8a8_kernel() is not None:
        _assert_fused_equals_modules(int8("float32"), monkeypatch, quantized=True)
        with monkeypatch.context() as short:
            short.setattr(quant_linear, "mem_total_bytes", lambda: 1)
            _assert_fused_equals_modules(int8("float32"), short, quantized=False)
            _assert_fused_equals_modules(int8(), short, quantized=False)
    # Without it (PAGODA_NO_W8A8=1 here), int8 in bf16 with AVX512-BF16: rows kept beside the bf16 GEMM's
    # order (the few-rows integer path; beyond it the modules' GEMM), or, where memory is short, the
    # GEMM's order alone: every row count fused.
    monkeypatch.setenv("PAGODA_NO_W8A8", "1")
    _assert_fused_equals_modules(int8(), monkeypatch, quantized=True)
    monkeypatch.setattr(quant_linear, "mem_total_bytes", lambda: 1)
    _assert_fused_equals_modules(int8(), monkeypatch, quantized=gemm_kernel() is None)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_step_equals_the_modules_with_quantized_experts(tmp_path, monkeypatch, arch):
    """Experts kept quantized (model/quantized.QuantExperts): a GGUF's blocks (gate and up in two
    formats), int8 experts on the rows beside the W8A8 copy, and the W8A8 order alone (memory short:
    every row count fused)."""
    pytest.importorskip("gguf")
    from tests.model.test_moe_gguf import GGUF_ARCH, write_moe_gguf

    hf = save_tiny_model(arch, tmp_path / "hf", **({"mlp_only_layers": []} if arch == "qwen3_moe" else {}))
    path = tmp_path / "moe.gguf"
    write_moe_gguf(hf, path, GGUF_ARCH[arch], "Q8_0", {"ffn_up_exps": "Q4_0"})
    _assert_fused_equals_modules(lambda: load_model(str(path), dtype="float32", quantization="gguf"), monkeypatch,
                                 quantized=True)

    def int8():
        return load_model(str(tmp_path / "hf"), dtype="float32", quantization="int8")

    _assert_fused_equals_modules(int8, monkeypatch, quantized=True)
    if quant_linear.w8a8_kernel() is not None:
        monkeypatch.setattr(quant_linear, "mem_total_bytes", lambda: 1)
        _assert_fused_equals_modules(int8, monkeypatch, quantized=False)


def test_fused_step_follows_weights_replaced_under_it(tmp_path, monkeypatch):
    """A weight update hands packed weights over as new tensors, and sleep level 2 repacks them on
    wake: the next fused step must read those, not the ones its plan was built with."""
    a, b = tmp_path / "a", tmp_path / "b"
    save_tiny_model("llama3", a, seed=0)
    save_tiny_model("llama3", b, seed=1)
    want_b, _, _ = _outputs(load_model(str(b), dtype="float32", device="cpu"), monkeypatch, fused=True)
    want_a, rows, llm = _outputs(load_model(str(a), dtype="float32", device="cpu"), monkeypatch, fused=True)
    assert want_a != want_b and rows
    llm.update_weights(str(b))
    batch = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [_params(i) for i in range(len(PROMPTS))]

    def outputs():
        return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs])
                for o in llm.generate(batch, params, use_tqdm=False)]

    assert outputs() == want_b[1 : 1 + len(PROMPTS)]
    packed = weakref.ref(llm.engine.core.runner.model.model.layers[0].mlp.down_proj.packed)
    llm.sleep(level=2)
    gc.collect()
    assert packed() is None  # parking freed the packed weight: the plan let go of it
    llm.wake_up()
    assert outputs() == want_b[1 : 1 + len(PROMPTS)]


@pytest.mark.parametrize("arch,dtype", [("mixtral", "float32"), ("qwen3_moe", "float32"), ("qwen2_moe", "bfloat16")])
def test_models_it_does_not_serve_take_the_modules(tmp_path, arch, dtype):
    # float32 experts stay oneDNN-packed, off the grouped kernel; qwen2_moe has a shared expert
    save_tiny_model(arch, tmp_path)
    llm = make_engine(load_model(str(tmp_path), dtype=dtype, device="cpu"), num_gpu_blocks_override=64)
    assert llm.engine.core.runner.fused_decode is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], _params(1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 7


def test_the_off_switch_and_other_devices(monkeypatch, tmp_path):
    save_tiny_model("llama3", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    monkeypatch.setenv("PAGODA_NO_FUSED_DECODE", "1")
    assert FusedCPUDecoder.create(loaded.model, object(), torch.device("cpu")) is None
    monkeypatch.delenv("PAGODA_NO_FUSED_DECODE")
    assert FusedCPUDecoder.create(loaded.model, object(), torch.device("meta")) is None
