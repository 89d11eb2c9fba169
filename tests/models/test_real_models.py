"""Real chat-model families meet winnow's prompt path: Llama 3.x and Qwen2.5, scaled down.

The tokenizers carry the families' published chat templates and special tokens
(``tests/fixtures/real_models``); the models are random, with the published configs
scaled down. Checked: winnow's prompt ids are the ids ``transformers`` gives (never two
BOS tokens), winnow's greedy generation through the local engine equals
``transformers.generate(do_sample=False)`` token for token, and generation stops at each
of the model's stop ids. (Qwen3's conversion, parity and RL from a folder are in ``tests/checkpoint``.)
"""

from __future__ import annotations

import pytest
import torch

from pipeline.data import load_prompts
from pipeline.data.templates import chat_messages, prompt_token_ids, render_prompt
from pipeline.models.tokenizer import load_tokenizer, stop_token_ids
from pipeline.rollout.types import GenerationRequest, SamplingParams
from tests.fixtures.real_models.families import FAMILIES, tokenizer_dir, write_hf_model

# The published stop tokens of each family's instruct models (generation_config.json eos_token_id
# plus the tokenizer's EOS) and what every prompt starts with.
STOP_TOKENS = {"llama3": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "qwen2_5": ["<|endoftext|>", "<|im_end|>"]}
FIRST_TOKEN = {"llama3": "<|begin_of_text|>", "qwen2_5": "<|im_start|>"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizer(family):
    return load_tokenizer(tokenizer_dir(family))


@pytest.fixture(scope="module")
def problems():
    return load_prompts("gsm8k", split="test", limit=4)[0]


@pytest.fixture(scope="module")
def hf_folder(family, tmp_path_factory):
    return write_hf_model(family, tmp_path_factory.mktemp(family) / "hf")


def test_chat_prompts_are_exactly_the_ids_of_apply_chat_template(family, tokenizer, problems):
    for problem in problems:
        ids = prompt_token_ids(tokenizer, problem, template="chat")
        expected = tokenizer.apply_chat_template(chat_messages(problem.problem), add_generation_prompt=True,
                                                 tokenize=True)["input_ids"]
        assert ids == expected
        assert tokenizer.convert_ids_to_tokens(ids[:2])[0] == FIRST_TOKEN[family]
        assert ids[1] != ids[0]  # one start token, not two
        # The doubled-BOS bug this replaces: the rendered text encoded with special tokens.
        text = render_prompt(problem, template="chat", tokenizer=tokenizer)
        doubled = tokenizer.encode(text, add_special_tokens=True)
        assert (doubled[:2] == [ids[0], ids[0]]) == (family == "llama3")


@pytest.mark.parametrize("template", ["plain", "raw"])
def test_plain_and_raw_prompts_follow_the_tokenizer_special_token_settings(family, tokenizer, problems, template):
    for problem in problems:
        ids = prompt_token_ids(tokenizer, problem, template=template)
        text = render_prompt(problem, template=template)
        assert ids == tokenizer(text, add_special_tokens=True)["input_ids"]
        if family == "llama3":  # Llama 3's post-processor prepends <|begin_of_text|>; Qwen2.5 adds nothing
            assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
        else:
            assert tokenizer.bos_token_id is None and ids == tokenizer.encode(text, add_special_tokens=False)


def test_a_prompt_that_writes_its_own_bos_keeps_one(tokenizer, family):
    if tokenizer.bos_token_id is None:
        pytest.skip(f"{family} has no BOS token")
    ids = prompt_token_ids(tokenizer, tokenizer.bos_token + "What is 2 + 3?", template="raw")
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id


def test_stop_ids_are_the_generation_config_list_plus_the_tokenizer_eos(family, tokenizer):
    ids = stop_token_ids(tokenizer, folders=[tokenizer_dir(family)])
    assert tokenizer.convert_ids_to_tokens(list(ids)) == STOP_TOKENS[family]
    assert tokenizer.eos_token_id in ids


def _policy_engine(hf_folder):
    """The policy and engine as `winnow curate` / `winnow evaluate` build them for an HF folder."""
    from pipeline.eval.policy import load_policy
    from pipeline.eval.sharded import SamplingOptions, ShardSampler

    policy = load_policy(hf_folder)
    options = SamplingOptions(num_samples=1, max_new_tokens=1, temperature=0.0, top_p=1.0, template="chat")
    return policy, ShardSampler(policy, options=options, grading_pool=lambda: None, show_progress=False).engine


def _transformers_greedy(hf_folder, prompt_ids: list[list[int]], *, max_new_tokens: int, model=None):
    """``transformers``' own greedy generation, one prompt at a time (its generation_config stops it)."""
    from transformers import AutoModelForCausalLM

    model = model or AutoModelForCausalLM.from_pretrained(str(hf_folder), local_files_only=True, dtype=torch.float32)
    outputs = []
    for ids in prompt_ids:
        input_ids = torch.tensor([ids])
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, temperature=None, top_p=None, top_k=None,
                             repetition_penalty=None)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def test_greedy_generation_equals_transformers_token_for_token(family, hf_folder, tokenizer, problems):
    policy, engine = _policy_engine(hf_folder)
    prompt_ids = [prompt_token_ids(policy.tokenizer, p, template="chat") for p in problems]
    assert prompt_ids == [tokenizer.apply_chat_template(chat_messages(p.problem), add_generation_prompt=True)["input_ids"]
                          for p in problems]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=engine.eos_token_ids, seed=0)
    completions = engine.generate([GenerationRequest(prompt_id=p.id, prompt_token_ids=ids, num_samples=1)
                                   for p, ids in zip(problems, prompt_ids)], params)
    expected = _transformers_greedy(hf_folder, prompt_ids, max_new_tokens=32)
    assert [c.token_ids.tolist() for c in completions] == expected
    assert sorted(engine.eos_token_ids) == sorted(policy.tokenizer.convert_tokens_to_ids(STOP_TOKENS[family]))


def test_generation_stops_at_each_stop_id(family, hf_folder, problems):
    policy, engine = _policy_engine(hf_folder)
    ids = prompt_token_ids(policy.tokenizer, problems[0], template="chat")
    forced = {"token": None}

    def force(module, inputs, logits):  # the forced token wins by a wide margin at every position
        logits = logits.clone()
        logits[..., forced["token"]] += 1e4
        return logits

    handle = policy.hf_model.lm_head.register_forward_hook(force)
    try:
        stop_ids = policy.tokenizer.convert_tokens_to_ids(STOP_TOKENS[family])
        other = policy.tokenizer.convert_tokens_to_ids(FIRST_TOKEN[family])
        for token in [*stop_ids, other]:
            forced["token"] = token
            params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=engine.eos_token_ids, seed=0)
            (completion,) = engine.generate([GenerationRequest(prompt_id="q", prompt_token_ids=ids, num_samples=1)],
                                            params)
            if token == other:
                assert completion.token_ids.tolist() == [token] * 6 and completion.finish_reason == "length"
            else:
                assert completion.token_ids.tolist() == [token] and completion.finish_reason == "stop"
            # transformers stops at the same place with the model's own generation_config.json.
            assert _transformers_greedy(hf_folder, [ids], max_new_tokens=6, model=policy.hf_model) == [
                completion.token_ids.tolist()]
    finally:
        handle.remove()
