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
    prompts = [[1, 5, 7, 9], [1, 3], [1, 4, 4, 4, 4, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 6]]
    seen = []  # (rows, padded length) of each batch the decoder ran
    model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    head_rows = []  # positions of each call of the vocabulary head
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: head_rows.append(args[0].shape[0]))
    by_rows = question_mean_logprobs(model, prompts, pad_id=0, batch_rows=2)
    # A token budget cuts batches before the row limit: never more than 12 padded positions,
    # and a prompt longer than the budget runs alone.
    by_tokens = question_mean_logprobs(model, prompts, pad_id=0, batch_rows=64, batch_tokens=12)
    assert seen[:3] == [(2, 4), (2, 9), (1, 2)]
    assert seen[3:] == [(2, 4), (1, 6), (1, 9), (1, 2)]
    # The head sees only real positions (3 + 1 of the first batch's rows, not 2 × 3 padded), by default in one go.
    assert head_rows[0] == 4
    head_rows.clear()
    # ... and at most head_tokens of them at a time: the logits of a whole batch never exist at once.
    by_chunks = question_mean_logprobs(model, prompts, pad_id=0, batch_rows=64, head_tokens=3)
    assert head_rows and max(head_rows) == 3 and sum(head_rows) == sum(len(ids) - 1 for ids in prompts)
    for got in (by_rows, by_tokens, by_chunks):
        for row, ids in enumerate(prompts):  # one prompt at a time, no padding: the reference
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0].double()
            expected = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).mean()
            np.testing.assert_allclose(got[row], float(expected), rtol=0, atol=1e-5)


def test_question_mean_logprobs_feed_the_model_on_its_own_device():
    """A GPU policy gets its inputs on the GPU (there, CPU tensors would be an error); here a
    model whose parameter lives on the meta device records where its inputs arrive."""
    from pipeline.stages.curate import question_mean_logprobs

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.empty(1, device="meta"))
            self.devices = []

        def get_decoder(self):
            return self

        def get_output_embeddings(self):
            return torch.nn.Linear(4, 8, device="meta")

        def forward(self, *, input_ids, attention_mask):
            self.devices.append((input_ids.device.type, attention_mask.device.type))
            return type("Output", (), {"last_hidden_state": torch.zeros(*input_ids.shape, 4)})()  # (B, T, H)

    model = Recorder()
    try:
        question_mean_logprobs(model, [[1, 2, 3], [1, 2]], pad_id=0)
    except (NotImplementedError, RuntimeError):
        pass  # meta tensors hold no values; where they arrived is the point
    assert model.devices == [("meta", "meta")]
