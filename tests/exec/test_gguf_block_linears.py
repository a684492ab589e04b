"""A GGUF-loaded bf16 model's second copy of its linears in the file's blocks
(exec/gguf_block_linears.py, exec/csrc/block_tile.h): the blocks widen to the loader's bf16 values,
the GEMM over them gives the bf16 GEMM's bits, a copy that does not widen to the weight is never
used, the engine's greedy tokens and logprobs are the same with and without it, and a weight update
from a file without blocks drops it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pagoda import SamplingParams
from pagoda.exec.cpu_linear import (BLOCK_ROWS, PackedLinear, PackedLMHead, block_copy, decode_step, exact_block_rows,
                                    gemm_kernel, pack_gemm)
from pagoda.exec.gguf_block_linears import pack_blocks, widen_blocks
from pagoda.exec.weight_tensors import check_same_layout, copy_weights
from pagoda.model.loader import load_model
from pagoda.model.quantized import QuantizedTensor
from tests.conftest import make_engine

gguf = pytest.importorskip("gguf")
needs_gemm = pytest.mark.skipif(gemm_kernel() is None, reason="the CPU has no AVX512-BF16 (the bf16 GEMM is not used)")
pytestmark = pytest.mark.usefixtures("our_bf16_gemm")

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _part(qtype: str, rows: int, cols: int, seed: int) -> QuantizedTensor:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return QuantizedTensor(qtype, rows, cols, torch.from_numpy(np.ascontiguousarray(blocks)))


def _loaded_bf16(parts: list[QuantizedTensor]) -> torch.Tensor:
    """What the loader makes of the parts: gguf-py's float32 dequantization, rounded to bf16."""
    return torch.cat([p.dequantize() for p in parts]).to(torch.bfloat16)


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_widen_to_the_loaders_bf16_values(qtype):
    parts = [_part(qtype, 200, 96, 1), _part(qtype, 70, 96, 2)]  # a merged projection, rows not a multiple of 64
    blocks = pack_blocks(parts)
    assert blocks.dtype == torch.uint8 and blocks.shape[:2] == (5, 3)
    widened = widen_blocks(blocks, 270)
    assert torch.equal(widened, _loaded_bf16(parts))


def _copy(parts, weight):
    return block_copy(parts, weight, pack_gemm(weight))


@needs_gemm
@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernels_widening_is_checked_value_for_value(qtype):
    """What is kept is what the C++ check passes: blocks that widen to the weight, and no others."""
    parts = [_part(qtype, 200, 96, 1), _part(qtype, 70, 96, 2)]
    weight = _loaded_bf16(parts)
    assert torch.equal(_copy(parts, weight), pack_blocks(parts))
    for row, col in ((0, 0), (77, 5), (269, 95)):
        changed = weight.clone()
        changed[row, col] = changed[row, col] * 2 + 1
        assert _copy(parts, changed) is None


def test_a_copy_that_cannot_serve_the_weight_is_not_kept():
    parts = [_part("Q4_1", 128, 64, 3)]
    weight = _loaded_bf16(parts)
    assert _copy(parts, weight[:64]) is None  # another shape (a tensor-parallel shard)
    mixed = [parts[0], _part("Q8_0", 64, 64, 4)]
    assert _copy(mixed, _loaded_bf16(mixed)) is None  # one format per linear
    k_quant = QuantizedTensor("Q4_K", 128, 256, torch.zeros(128, 144, dtype=torch.uint8))
    assert _copy([k_quant], torch.zeros(128, 256, dtype=torch.bfloat16)) is None
    assert _copy(None, weight) is None


@needs_gemm
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_gemm_over_blocks_gives_the_bf16_gemms_bits(qtype, rows):
    """Up to 8 rows read the blocks (4 in one pass, 5-8 in two halves), more the bf16 copy: the same
    bits either way."""
    parts = [_part(qtype, 200, 576, rows)]
    weight = _loaded_bf16(parts)
    blocks, packed = pack_blocks(parts), pack_gemm(weight)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2 * rows, 576, generator=g).to(torch.bfloat16)[::2]  # strided rows
    bias = torch.randn(200, generator=g).to(torch.bfloat16)
    for b in (None, bias):
        want = gemm_kernel().gemm_bf16(x, packed, b, 200)
        got = gemm_kernel().gemm_bf16(x, packed, b, 200, blocks)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    exact = x.double() @ weight.double().t()
    assert ((got.double() - bias.double() - exact).abs() <= exact.abs() * 2.0**-7 + 0.05).all()


@needs_gemm
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_paired_gate_up_keeps_its_blocks_for_a_few_rows(qtype):
    """An MLP's gate_up packed in gate/up pairs (exec/cpu_linear.py) keeps the blocks in [gate | up]
    order: up to 8 rows its SiLU-and-multiply reads them, more the paired bf16 copy, with the bits of
    the unpaired linear followed by silu_and_mul either way."""
    from pagoda.model.layers import silu_and_mul

    parts = [_part(qtype, 96, 576, 1), _part(qtype, 96, 576, 2)]  # gate, up: 96 columns, not a multiple of 64
    linear = torch.nn.Linear(576, 192, bias=False).to(torch.bfloat16)
    linear.weight.data = _loaded_bf16(parts)
    plain, paired = PackedLinear(linear, parts), PackedLinear(linear, parts, gate_up=True)
    assert paired.fuses_silu and paired.blocks is not None and torch.equal(paired.blocks, plain.blocks)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 8, 9, 64):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        assert torch.equal(paired.silu_and_mul(x).view(torch.int16), silu_and_mul(plain(x)).view(torch.int16))
        assert torch.equal(paired(x), plain(x))


@needs_gemm
def test_gemm_refuses_blocks_of_another_shape():
    parts = [_part("Q4_1", 128, 64, 5)]
    with pytest.raises(RuntimeError, match="blocks do not match"):
        gemm_kernel().gemm_bf16(torch.zeros(1, 128, dtype=torch.bfloat16),
                                pack_gemm(torch.zeros(128, 128, dtype=torch.bfloat16)), None, 128, pack_blocks(parts))


PROMPTS = [[5, 17, 99, 3], [200, 201, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [42]]


def _greedy(path):
    llm = make_engine(load_model(str(path), dtype="bfloat16"), num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@needs_gemm
@pytest.mark.parametrize("qtype", TYPES)
def test_engine_output_is_the_same_with_and_without_blocks(tmp_path, monkeypatch, qtype):
    from tests.model.test_gguf_and_errors import write_tiny_gguf
    from tests.tiny_models import save_tiny_model

    hf = save_tiny_model("llama_linear", tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(hf, path, qtype)
    with_blocks = _greedy(path)
    loaded = load_model(str(path), dtype="bfloat16")
    assert loaded.model.gguf_file == str(path)
    make_engine(loaded, num_gpu_blocks_override=64)  # packs the runner's linears in place
    linears = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.blocks is not None for m in linears)
    monkeypatch.setenv("PAGODA_NO_GGUF_BLOCKS", "1")
    without = _greedy(path)
    assert with_blocks == without  # tokens and logprobs, exactly


class _Holder:
    def __init__(self, weight: torch.Tensor, blocks: torch.Tensor | None) -> None:
        self.weight, self.blocks = weight, blocks


def test_a_replacement_without_blocks_drops_the_served_copy():
    """A served GGUF model updated from another file: its blocks would be the old weights, so they
    go, and the bf16 copy (updated) serves alone."""
    holder = _Holder(torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(1, 1, 1280, dtype=torch.uint8))
    served = {"layer.weight": (holder, "weight"), "layer.blocks": (holder, "blocks")}
    new = {"layer.weight": torch.ones(64, 32, dtype=torch.bfloat16)}
    check_same_layout({name: getattr(o, a) for name, (o, a) in served.items()}, new, "new.safetensors")
    copy_weights(served, new)
    assert holder.blocks is None and torch.equal(holder.weight, new["layer.weight"])
    with pytest.raises(ValueError, match="missing"):  # any other tensor still has to be there
        check_same_layout({"layer.weight": holder.weight, "other.weight": holder.weight}, new, "new.safetensors")


# A bf16 head is packed for our GEMM only where it is used (AVX512-BF16); elsewhere oneDNN would be
# asked to pack bf16, which it refuses without AVX512-BW/VL/DQ (PAGODA_CPU_ISA=avx2 hides them).
@needs_gemm
def test_the_head_keeps_its_blocks_only_where_they_widen_to_it():
    parts = [_part("Q8_0", 96, 64, 6)]
    weight = _loaded_bf16(parts)
    assert PackedLMHead(weight, parts).blocks is not None
    assert PackedLMHead(weight * 2, parts).blocks is None


@needs_gemm
def test_smollm2_bf16_decodes_through_its_blocks_to_the_same_tokens(monkeypatch, smollm2_tokenizer, smollm2_prompt_ids):
    """The default model in bf16: its 120 linears and its head keep their Q4_1 / Q8_0 blocks, and
    decode steps of 1 and of 8 rows (which take them) give the tokens and logprobs of the bf16 copy
    alone, which tests/model/test_smollm2_reference.py holds to transformers."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    def run(blocks: bool):
        monkeypatch.setenv("PAGODA_NO_GGUF_BLOCKS", "0" if blocks else "1")
        loaded = load_model(None, dtype="bfloat16")
        llm = make_engine(loaded, smollm2_tokenizer, enable_prefix_caching=False, num_gpu_blocks_override=256)
        linears = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
        assert len(linears) == 120 and all((m.blocks is not None) == blocks for m in linears)
        outs = llm.generate([{"prompt_token_ids": p} for p in smollm2_prompt_ids[:8]], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": smollm2_prompt_ids[9]}], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    assert run(True) == run(False)


def _amx(monkeypatch):
    """As on a CPU whose oneDNN has AMX: bf16 linears packed for oneDNN, their blocks beside them."""
    from pagoda.exec import cpu_linear

    monkeypatch.setattr(cpu_linear, "cpu_has_amx", lambda: True)
    monkeypatch.delenv("PAGODA_BF16_GEMM")


@needs_gemm
@pytest.mark.parametrize("qtype", TYPES)
def test_with_amx_a_few_rows_read_the_blocks_and_the_rest_onednn(monkeypatch, qtype):
    """With AMX (here, or emulated: cpu_has_amx patched on a CPU without), bf16 linears are oneDNN's.
    On AMX tiles the blocks give oneDNN's bits and serve up to 32 rows of any step, but for a step of
    decodes' one row, which our kernel sums; a step of decodes reads them on the tiles up to 64 rows,
    k summed in order (its 16-row groups' bits) where oneDNN splits k from 33 rows. Without the tiles
    our kernel serves up to 8 rows of a step of decodes only."""
    from pagoda.exec import cpu_linear

    _amx(monkeypatch)
    exact = cpu_linear.exact_block_rows()
    assert exact in (0, 32)
    parts = [_part(qtype, 200, 576, 7)]
    linear = torch.nn.Linear(576, 200).to(torch.bfloat16)
    linear.weight.data = _loaded_bf16(parts)
    packed, head = PackedLinear(linear, parts), PackedLMHead(linear.weight, parts)
    assert not packed.gemm and packed.packed.is_mkldnn and packed.blocks is not None
    assert not head.gemm and head.packed.is_mkldnn and head.blocks is not None
    ours, bias = pack_gemm(linear.weight), linear.bias.detach()  # a bias needing grad: oneDNN adds it apart
    g = torch.Generator().manual_seed(1)

    def by_groups(x: torch.Tensor, b: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
        return torch.cat([gemm_kernel().gemm_bf16_blocks(x[i:i + 16].contiguous(), blocks, b, 200, True)
                          for i in range(0, x.shape[0], 16)])

    for rows in (1, 2, 5, 8, 9, 16, 17, 32, 33, 40, 64, 65):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        onednn, onednn_head = cpu_linear._packed_linear(x, packed.packed, bias), cpu_linear._packed_linear(x, head.packed, None)
        for decodes in (False, True):
            with decode_step(decodes):
                most, ours_rows = ((64, 1) if exact else (8, 8)) if decodes else (exact, 0)
                assert cpu_linear.block_rows() == (most, ours_rows)
                tiles = cpu_linear._on_blocks(x, packed.blocks)
                assert tiles == (None if rows > most else rows > ours_rows)
                want, want_head = onednn, onednn_head
                if rows <= ours_rows:  # our kernel's bits over the blocks
                    want = gemm_kernel().gemm_bf16(x, ours, bias, 200, packed.blocks)
                    want_head = gemm_kernel().gemm_bf16(x, ours, None, 200, head.blocks)
                elif exact < rows <= most:  # the tiles past oneDNN's k split: each 16 rows' own bits
                    want, want_head = by_groups(x, bias, packed.blocks), by_groups(x, None, head.blocks)
                assert torch.equal(packed(x).view(torch.int16), want.view(torch.int16))
                assert torch.equal(head(x).view(torch.int16), want_head.view(torch.int16))
    assert gemm_kernel().BLOCK_ROWS_MAX == BLOCK_ROWS  # the rows the runner and the modules give the blocks
    for tiles, most in ((False, 8), (True, gemm_kernel().AMX_ROWS_MAX)) if exact else ((False, 8),):
        with pytest.raises(RuntimeError, match=f"at most {most} rows"):
            gemm_kernel().gemm_bf16_blocks(torch.zeros(most + 1, 576, dtype=torch.bfloat16), packed.blocks, None, 200, tiles)


needs_amx = pytest.mark.skipif(not exact_block_rows(), reason="no AMX here (nor oneDNN on it): nothing to match")


@needs_amx
@pytest.mark.parametrize("qtype", TYPES)
def test_on_amx_tiles_the_blocks_round_as_onednn(qtype):
    """The blocks summed on AMX tiles give oneDNN's bf16 GEMM's bits, value for value, for 1-32 rows
    of SmolLM2's shapes (and a width that is no multiple of 64), with and without a bias."""
    from pagoda.exec import cpu_linear

    g = torch.Generator().manual_seed(2)
    for i, (n, k) in enumerate([(960, 576), (576, 576), (3072, 576), (576, 1536), (200, 576)]):
        parts = [_part(qtype, n, k, 10 + i)]
        blocks, onednn = pack_blocks(parts), cpu_linear._pack(_loaded_bf16(parts))
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        for rows in range(1, 33):
            x = torch.randn(2 * rows, k, generator=g).to(torch.bfloat16)[::2]  # strided rows
            for b in (None, bias):
                want = cpu_linear._packed_linear(x.contiguous(), onednn, b)
                assert torch.equal(gemm_kernel().gemm_bf16_blocks(x, blocks, b, n, True).view(torch.int16),
                                   want.view(torch.int16)), (n, k, rows, b is None)


@needs_amx
@pytest.mark.parametrize("qtype", TYPES)
def test_on_amx_tiles_more_rows_sum_as_onednn_sums_sixteen(qtype):
    """Past 32 rows (a step of decodes) the tiles still sum k in order from zero: every row gets the
    bits oneDNN gives it in a step of 16 rows (where oneDNN itself, from 33 rows, splits k), at any
    count up to the most, rows strided or not (contiguous whole groups of 32 rows are read in place,
    the rest from a zero-padded copy), with and without a bias."""
    from pagoda.exec import cpu_linear

    g = torch.Generator().manual_seed(4)
    for i, (n, k) in enumerate([(960, 576), (3072, 576), (576, 1536), (200, 576)]):
        parts = [_part(qtype, n, k, 20 + i)]
        blocks, onednn = pack_blocks(parts), cpu_linear._pack(_loaded_bf16(parts))
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        for rows in (33, 47, 64, 65, 100, gemm_kernel().AMX_ROWS_MAX):
            strided = torch.randn(2 * rows, k, generator=g).to(torch.bfloat16)[::2]
            for x, b in itertools.product((strided, strided.contiguous()), (None, bias)):
                want = torch.cat([cpu_linear._packed_linear(x[r:r + 16].contiguous(), onednn, b) for r in range(0, rows, 16)])
                assert torch.equal(gemm_kernel().gemm_bf16_blocks(x, blocks, b, n, True).view(torch.int16),
                                   want.view(torch.int16)), (n, k, rows, b is None, x.is_contiguous())


@needs_gemm
@pytest.mark.parametrize("qtype", TYPES)
def test_silu_of_gate_up_over_blocks_is_the_projection_then_silu_and_mul(qtype):
    """gemm_bf16_blocks_silu (a step of decodes' MLP input, SiLU in the GEMM's epilogue) gives the
    bits of gemm_bf16_blocks over [gate | up] then silu_and_mul: on our GEMM up to 8 rows, and on AMX
    tiles (where this CPU has them) up to the most, rows strided or not; n not a multiple of 64 is
    refused."""
    from pagoda.model.cpu_layer_ops import load_layer_ops

    silu_and_mul = load_layer_ops().silu_and_mul
    inter, k = 128, 576
    blocks = pack_blocks([_part(qtype, 2 * inter, k, 31)])
    g = torch.Generator().manual_seed(31)
    counts = [(rows, False) for rows in (1, 5, 8)]
    if exact_block_rows():
        counts += [(rows, True) for rows in (1, 16, 32, 33, 64, 100, gemm_kernel().AMX_ROWS_MAX)]
    for rows, tiles in counts:
        strided = torch.randn(2 * rows, k, generator=g).to(torch.bfloat16)[::2]
        for x in (strided, strided.contiguous()):
            want = silu_and_mul(gemm_kernel().gemm_bf16_blocks(x, blocks, None, 2 * inter, tiles))
            got = gemm_kernel().gemm_bf16_blocks_silu(x, blocks, inter, tiles)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rows, tiles, x.is_contiguous())
    with pytest.raises(RuntimeError, match="multiple of 64"):
        gemm_kernel().gemm_bf16_blocks_silu(strided[:1], pack_blocks([_part(qtype, 2 * 96, k, 32)]), 96, False)


@needs_amx
def test_a_shape_that_onednn_sums_otherwise_keeps_no_blocks(monkeypatch):
    """Each shape's tiles are checked against oneDNN once; where one output differs (oneDNN summing
    that shape otherwise), its linears keep no blocks and run on oneDNN alone."""
    from pagoda.exec import cpu_linear

    _amx(monkeypatch)
    parts = [_part("Q4_1", 320, 576, 8)]
    linear = torch.nn.Linear(576, 320, bias=False).to(torch.bfloat16)
    linear.weight.data = _loaded_bf16(parts)
    assert PackedLinear(linear, parts).blocks is not None and cpu_linear._tile_checks[(320, 576, 1280)]
    packed_linear = cpu_linear._packed_linear

    def one_bit_off(x, packed, bias):
        out = packed_linear(x, packed, bias)
        out.view(torch.int16)[0, 0] ^= 1
        return out

    monkeypatch.setattr(cpu_linear, "_packed_linear", one_bit_off)
    monkeypatch.setattr(cpu_linear, "_tile_checks", {})
    assert PackedLinear(linear, parts).blocks is None and PackedLMHead(linear.weight, parts).blocks is None


def _tiny_q4_1(tmp_path):
    from tests.model.test_gguf_and_errors import write_tiny_gguf
    from tests.tiny_models import save_tiny_model

    hf = save_tiny_model("llama_linear", tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(hf, path, "Q4_1")
    return path


@needs_gemm
def test_with_amx_a_prompt_rounds_as_onednn_at_any_length(tmp_path, monkeypatch):
    """A prompt's logprobs are oneDNN's alone, bit for bit, in the fused step and the modules, so a
    short prompt echoed scores its tokens as they score inside a longer one: on AMX tiles its few
    rows read the blocks (which round as oneDNN does), else none of its rows do. A decode step's few
    rows read them either way (the modules' calls)."""
    from pagoda.exec import cpu_linear

    _amx(monkeypatch)
    path = _tiny_q4_1(tmp_path)
    reads: list[int] = []
    gemm_linear = cpu_linear._gemm_linear

    def spy(x, packed, bias, n, blocks, gemm=True, tiles=False):
        if not gemm:
            reads.append(x.numel() // x.shape[-1])
        return gemm_linear(x, packed, bias, n, blocks, gemm, tiles)

    monkeypatch.setattr(cpu_linear, "_gemm_linear", spy)

    def scored():
        """Each prompt alone (so that the fused plan may take its step), its prompt logprobs."""
        llm = make_engine(load_model(str(path), dtype="bfloat16"), num_gpu_blocks_override=64,
                          enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                for p in ([5, 9, 2], PROMPTS[1][:8], PROMPTS[1])]
        return [[None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs] for o in outs]

    for no_fused in ("1", "0"):  # the modules, then the fused step
        monkeypatch.setenv("PAGODA_NO_FUSED_DECODE", no_fused)
        monkeypatch.setenv("PAGODA_NO_GGUF_BLOCKS", "0")
        with_blocks = scored()
        monkeypatch.setenv("PAGODA_NO_GGUF_BLOCKS", "1")
        assert scored() == with_blocks
    exact = cpu_linear.exact_block_rows()
    assert (reads and max(reads) <= exact) if exact else reads == []  # the short prompts' rows, their logprobs' head
    reads.clear()
    monkeypatch.setenv("PAGODA_NO_FUSED_DECODE", "1")
    monkeypatch.setenv("PAGODA_NO_GGUF_BLOCKS", "0")
    _greedy(path)
    assert reads and max(reads) <= (exact or 8)


@needs_gemm
def test_with_amx_the_fused_step_reads_the_blocks_as_the_modules_do(tmp_path, monkeypatch):
    """The fused decode step serves oneDNN's linears with their blocks for a few rows, with the
    modules' bits; the greedy tokens are those of oneDNN alone (the two differ in rare roundings)."""
    _amx(monkeypatch)
    path = _tiny_q4_1(tmp_path)
    loaded = load_model(str(path), dtype="bfloat16")
    llm = make_engine(loaded, num_gpu_blocks_override=64)
    assert llm.engine.core.runner.fused_decode is not None
    linears = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(not m.gemm and m.blocks is not None for m in linears)
    fused = _greedy(path)
    monkeypatch.setenv("PAGODA_NO_FUSED_DECODE", "1")
    assert _greedy(path) == fused  # tokens and logprobs, exactly
    monkeypatch.setenv("PAGODA_NO_GGUF_BLOCKS", "1")
    onednn = _greedy(path)
    if exact_block_rows():  # on AMX tiles the blocks round as oneDNN does
        assert onednn == fused
    assert [tokens for tokens, _ in onednn] == [tokens for tokens, _ in fused]
    assert np.allclose([lp for _, lps in onednn for lp in lps], [lp for _, lps in fused for lp in lps], atol=0.05)
