"""Sample n answers per problem with a rollout engine, grade them, and score pass@k.

Engine-agnostic (local or SGLang): prompts go in as token ids, completions come
back as token ids and are decoded with the policy's tokenizer; grading runs in the
bounded pool; pass@k uses the unbiased estimator of ``pipeline.eval.passk``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.data import Prompt
from pipeline.data.templates import prompt_token_ids
from pipeline.eval.passk import summarize
from pipeline.rollout.types import GenerationRequest, SamplingParams


@dataclass(slots=True)
class ProblemResult:
    prompt: Prompt
    num_samples: int
    num_correct: int
    responses: list[str] = field(repr=False)
    reasons: list[str] = field(repr=False)
    response_lengths: list[int] = field(repr=False)  # each response's generated tokens, in sample order

    @property
    def num_generated_tokens(self) -> int:
        """Generated tokens over the prompt's responses."""
        return sum(self.response_lengths)


def sample_and_grade(
    *,
    engine,
    tokenizer,
    prompts: Sequence[Prompt],
    num_samples: int,
    params: SamplingParams,
    pool,
    template: str,
) -> list[ProblemResult]:
    """Generate ``num_samples`` responses per prompt, grade them, count the correct ones."""
    requests = [
        GenerationRequest(prompt_id=prompt.id,
                          prompt_token_ids=prompt_token_ids(tokenizer, prompt, template=template),
                          num_samples=num_samples)
        for prompt in prompts
    ]
    completions = engine.generate(requests, params)
    texts = [tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in completions]
    by_id = {prompt.id: prompt for prompt in prompts}
    grades = pool.grade_batch([(text, by_id[c.prompt_id].answer, by_id[c.prompt_id].problem)
                               for text, c in zip(texts, completions)])
    results = {prompt.id: ProblemResult(prompt, 0, 0, [], [], []) for prompt in prompts}
    for completion, text, grade in zip(completions, texts, grades):
        result = results[completion.prompt_id]
        result.num_samples += 1
        result.num_correct += int(grade.is_correct)
        result.responses.append(text)
        result.reasons.append(str(grade.reason))
        result.response_lengths.append(int(completion.token_ids.numel()))
    return [results[prompt.id] for prompt in prompts]


def score(results: Sequence[ProblemResult], ks: Sequence[int]) -> dict[str, float]:
    """pass@k for every k ≤ n, avg@n and the number of problems."""
    n = np.array([r.num_samples for r in results])
    c = np.array([r.num_correct for r in results])
    return {**summarize(n, c, ks), "num_problems": float(len(results))}
