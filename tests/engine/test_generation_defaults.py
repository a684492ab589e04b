"""--generation-config (vLLM's semantics): the model's generation_config.json sets the defaults of a
request that leaves them unset, its extra EOS ids end every request, and a request's own values win.
Checked against transformers' generate() under the folder's GenerationConfig."""

from __future__ import annotations

import json

import pytest

from pagoda.config import EngineArgs
from pagoda.engine.generation_defaults import fill_unset, stop_ids_with_model_eos
from pagoda.engine.llm import LLM
from pagoda.engine.llm_engine import LLMEngine
from pagoda.model.errors import ModelLoadError
from pagoda.model.generation_config import GenerationDefaults, load_generation_defaults
from pagoda.model.loader import load_model, resolve_model
from pagoda.sampling_params import SamplingParams
from tests.model_files_helpers import MAX_TOKENS, PROMPT_IDS, REPETITION_PENALTY, save_model_with_generation_config


@pytest.fixture(scope="module")
def gen_model(tmp_path_factory):
    return save_model_with_generation_config(tmp_path_factory.mktemp("gen_config"))


@pytest.fixture(scope="module")
def loaded(gen_model):
    return load_model(str(gen_model.folder), dtype="float32")


def _llm(gen_model, loaded, generation_config: str = "auto") -> LLM:
    args = EngineArgs(model=str(gen_model.folder), dtype="float32", num_gpu_blocks_override=32,
                      generation_config=generation_config)
    return LLM.from_engine(LLMEngine(args, loaded))


def test_defaults_are_what_transformers_reads(gen_model):
    from transformers import GenerationConfig

    d = load_generation_defaults(resolve_model(str(gen_model.folder)))
    hf = GenerationConfig.from_pretrained(gen_model.folder)
    assert d.sampling == {"temperature": hf.temperature, "top_p": hf.top_p, "top_k": hf.top_k,
                          "repetition_penalty": hf.repetition_penalty}
    assert d.eos_token_ids == tuple(hf.eos_token_id) == (2, gen_model.extra_eos)
    assert load_generation_defaults(resolve_model(str(gen_model.folder)), "vllm") == GenerationDefaults()


def test_unset_params_sample_with_the_models_defaults_as_transformers_does(gen_model, loaded):
    llm = _llm(gen_model, loaded)
    params = llm.get_default_sampling_params()
    assert (params.top_k, params.repetition_penalty, params.temperature, params.top_p) == (1, REPETITION_PENALTY, 0.7, 0.9)
    params.max_tokens = MAX_TOKENS
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0].outputs[0]
    # transformers' generate() under the same GenerationConfig: penalised greedy, ended by the extra EOS id.
    assert out.token_ids == gen_model.hf_reference == gen_model.penalised[: gen_model.stop_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", gen_model.extra_eos)
    # generate() without sampling params at all takes the same defaults (max_tokens 16 is long enough).
    again = llm.generate({"prompt_token_ids": PROMPT_IDS}, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids


def test_a_requests_own_params_win_but_the_extra_eos_still_ends_it(gen_model, loaded):
    llm = _llm(gen_model, loaded)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)  # no penalty: the request says so
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == gen_model.plain  # never meets the extra EOS id
    ignore = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=REPETITION_PENALTY, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, ignore, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == gen_model.penalised  # ignore_eos: the extra EOS id does not stop it either


def test_generation_config_vllm_ignores_the_file(gen_model, loaded):
    llm = _llm(gen_model, loaded, "vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                       repetition_penalty=REPETITION_PENALTY), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == gen_model.penalised and out.finish_reason == "length"  # no extra EOS id


def test_generation_config_folder_seeded_sampling_equals_explicit_params(gen_model, loaded, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.8, "top_p": 0.7}))
    llm = _llm(gen_model, loaded, str(tmp_path))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (0.8, 0.7, 0, 1.0)
    prompts = [{"prompt_token_ids": PROMPT_IDS}] * 4
    by_default = llm.generate(prompts, [defaults.clone(seed=s, max_tokens=MAX_TOKENS) for s in range(4)], use_tqdm=False)
    explicit = [SamplingParams(temperature=0.8, top_p=0.7, seed=s, max_tokens=MAX_TOKENS) for s in range(4)]
    by_hand = llm.generate(prompts, explicit, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_default] == [o.outputs[0].token_ids for o in by_hand]
    # Sampled, not greedy: the four seeds do not all agree.
    assert len({tuple(o.outputs[0].token_ids) for o in by_hand}) > 1


def test_a_missing_generation_config_folder_is_one_clear_error(gen_model, tmp_path):
    with pytest.raises(ModelLoadError, match="no generation_config.json in that folder"):
        load_generation_defaults(resolve_model(str(gen_model.folder)), str(tmp_path))


def test_fill_unset_and_stop_ids_units():
    d = GenerationDefaults({"temperature": 0.6, "top_k": 20}, (7, 9))
    p = fill_unset(SamplingParams(temperature=0.1), d, ["top_k"])
    assert (p.temperature, p.top_k) == (0.1, 20)
    assert stop_ids_with_model_eos(SamplingParams(stop_token_ids=[9]), d, eos_token_id=7) == [9]
    assert stop_ids_with_model_eos(SamplingParams(stop_token_ids=[3]), d, eos_token_id=7) == [3, 9]
    assert stop_ids_with_model_eos(SamplingParams(ignore_eos=True), d, eos_token_id=None) == []
