"""A synthetic difficulty task the estimator tests share: questions whose pass rate is set by their digits."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture
def one_thread():
    # Two intra-op threads on two shared, loaded cores are ~100x slower for these tiny matmuls.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def digits_texts(num: int, seed: int) -> tuple[list[str], np.ndarray]:
    """Questions of 8 symbols whose pass rate is 1 − (number of digits)/8: a relation a tiny encoder can learn."""
    rng = np.random.default_rng(seed)
    texts, rates = [], []
    for _ in range(num):
        num_digits = int(rng.integers(0, 9))
        symbols = list(rng.choice(list("abcdefghij"), 8 - num_digits)) + list(rng.choice(list("0123456789"),
                                                                                          num_digits))
        rng.shuffle(symbols)
        texts.append("q: " + "".join(symbols))
        rates.append(1.0 - num_digits / 8)
    return texts, np.array(rates)
