import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rl.stream import PromptStream


@settings(max_examples=50, deadline=None)
@given(num_prompts=st.integers(1, 40), batch=st.integers(1, 17), seed=st.integers(0, 100))
def test_every_epoch_visits_every_prompt_exactly_once(num_prompts, batch, seed):
    stream = PromptStream(num_prompts, seed=seed)
    taken = torch.cat([stream.next(batch)[0] for _ in range(3 * num_prompts)])  # 3·batch epochs' worth
    for epoch in range(len(taken) // num_prompts):
        chunk = taken[epoch * num_prompts : (epoch + 1) * num_prompts]
        assert sorted(chunk.tolist()) == list(range(num_prompts))


def test_resume_from_state_continues_the_same_sequence():
    stream = PromptStream(10, seed=3)
    stream.next(7)
    resumed = PromptStream(10, seed=3)
    resumed.load_state_dict(stream.state_dict())
    assert torch.equal(stream.next(9)[0], resumed.next(9)[0])


def test_epoch_end_is_reported_and_order_changes_between_epochs():
    stream = PromptStream(6, seed=0)
    first, ended = stream.next(6)
    assert ended
    second, _ = stream.next(6)
    assert not torch.equal(first, second)


def test_mismatched_state_is_rejected():
    import pytest

    stream = PromptStream(5, seed=1)
    with pytest.raises(ValueError, match="written for 6 prompts"):
        stream.load_state_dict({"epoch": 0, "offset": 0, "num_prompts": 6, "seed": 1})
