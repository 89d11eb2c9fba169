"""The staged pipeline as one RL config: the composition the H100 campaigns run as their ``default``.

Curation samples the base policy; the DEPO estimator is trained on it; RL draws prompts from
the raw stream, DEPO drops the ones no sampling can rescue, Reinforce-Ada-Seq-BALANCE samples
each kept prompt until it has both outcomes, and the update is D³S's (samples and top-K
tokens on its schedule) with CW-GRPO's covariance weights on the kept tokens. The campaign
recipes wire the curation and the estimator around it (``recipes.campaigns``);
docs/reproducing.md, "The staged pipeline", justifies each part from the papers' ablations.

Each part is kept from working against another:

* DEPO's filter is evaluated on the pool Ada-Seq draws (up to N_max = 32 samples), not on the
  update group: it drops a prompt only when even 32 samples are predicted to be all correct or
  all wrong, the prompts Ada-Seq would spend its whole budget on for nothing. The hard prompts
  Ada-Seq exists to rescue, which a filter at the n = 4 update group would drop, stay.
* One sampler decides where the inference goes: Ada-Seq (E3's and Ada-Est's budgets are off).
* One entropy policy: E3's temperature controller is off, because it would raise τ to undo
  the entropy D³S's token selection lowers on purpose; CW-GRPO damps the extreme-covariance
  tokens that make entropy swing, and Ada-Seq-BALANCE keeps negatives in every group.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pipeline.config import RLConfig
from recipes.papers import ADA_SEQ_UPDATE_SIZE, with_ada_seq

# DEPO drops a prompt when its calibrated P(all of Ada-Seq's pool equal) exceeds this: 9 in 10 such
# prompts would spend all 32 samples on one outcome (the paper states no operating point).
POOL_ZERO_VARIANCE_THRESHOLD = 0.9


def staged_pipeline(base: RLConfig, *, sample_selector: Literal["d3s_cross", "d3s_intra"],
                    estimator_encoder: Literal["minilm", "tiny"], update_size: int = ADA_SEQ_UPDATE_SIZE) -> RLConfig:
    """``base`` trained by the staged pipeline: its method fields set, ``group_size`` = ``update_size``.

    - **DEPO filter** (``prompt_filter=depo``): no warm-up, since the campaign pre-trains the
      estimator on the curation of the same base policy (the cold start DEPO §3.2 warms up
      for); the event predicted, labelled and dropped on is the pool's (``zero_variance_samples``
      = Ada-Seq's ``max_samples``, 32: a pool that exited with both outcomes is a 0), dropped
      above ``POOL_ZERO_VARIANCE_THRESHOLD``; the paper's loss weights (§4.1, the defaults). A config run without
      ``algorithm.depo.estimator_dir`` starts from a fresh ``estimator_encoder``.
    - **Reinforce-Ada-Seq-BALANCE** at the authors' settings (``recipes.papers.with_ada_seq``):
      n = ``update_size`` (the paper's 4), so a matched GRPO is the paper's GRPO-n4.
    - **D³S**: ``sample_selector`` (cross-group for math-aligned backbones, within-group for
      Llama-3.1-8B-Instruct: D³S Table 7), top-K tokens, Eq. 10 aggregation, Table 6's
      schedule scaled to n: N_s from max(2, n/4) to n, K from 5% to 20%.
    - **CW-GRPO** weights on the tokens D³S keeps; **E3's temperature** off (``fixed``).

    Shared settings (clip range, KL, entropy bonus, rollout correction) are ``base``'s.
    """
    algorithm = with_ada_seq(base.algorithm, exit_rule="balance", update_size=update_size)
    algorithm = dataclasses.replace(
        algorithm, prompt_filter="depo",
        depo=dataclasses.replace(algorithm.depo, encoder=estimator_encoder, warmup_steps=0,
                                 threshold=POOL_ZERO_VARIANCE_THRESHOLD,
                                 zero_variance_samples=algorithm.ada_seq.max_samples),
        sample_selector=sample_selector, token_weights=["d3s_topk", "cw_grpo"], aggregation="d3s",
        d3s=dataclasses.replace(algorithm.d3s, num_keep_init=max(2, update_size // 4), num_keep_final=update_size),
        temperature="fixed",
    )
    return dataclasses.replace(base, group_size=update_size, algorithm=algorithm)
