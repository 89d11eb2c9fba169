"""The curation records the policy's question perplexity (DEPO's distillation target)."""

from __future__ import annotations

import numpy as np
import torch


def test_question_mean_logprobs_match_a_per_prompt_loop():
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.stages.curate import question_mean_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    prompts = [[1, 5, 7, 9], [1, 3], [1, 4, 4, 4, 4, 2]]
    got = question_mean_logprobs(model, prompts, pad_id=0, batch_rows=2)
    for row, ids in enumerate(prompts):  # one prompt at a time, no padding: the reference
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        expected = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).mean()
        np.testing.assert_allclose(got[row], float(expected), rtol=0, atol=1e-5)
