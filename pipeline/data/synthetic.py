"""Synthetic prompt sources with a known difficulty: reasoning-gym generators and ``arith``.

Every source has one integer knob, ``difficulty`` in ``1..5``, so curation sees a real
difficulty spectrum. It maps to each generator's own config as follows (``a-b`` is a
``min-max`` range the generator samples from per problem):

| source | 1 | 2 | 3 | 4 | 5 |
|---|---|---|---|---|---|
| ``rg:basic_arithmetic`` | 2 terms, 1 digit, + - | 2-3 terms, 1 digit, + - * | 3 terms, 1-2 digits, + - *, parentheses | 3-4 terms, 2 digits, + - * /, parentheses, negation | 4-6 terms, 2-3 digits, + - * /, parentheses, negation |
| ``rg:chain_sum`` | 2 terms, 1 digit | 2-3 terms, 1-2 digits | 3-4 terms, 2 digits | 4-5 terms, 2-3 digits | 5-6 terms, 3-4 digits |
| ``rg:simple_equations`` | 2 terms, values 1-10, + - | 2-3 terms, 1-20, + - | 2-3 terms, 1-50, + - * | 3-4 terms, 1-100, + - * | 4-5 terms, 1-1000, + - * |
| ``rg:fraction_simplification`` | values 1-10, factor 2-5 | 1-20, factor 2-10 | 1-100, factor 2-20 | 1-1000, factor 2-100 | 1-10000, factor 2-1000 |
| ``rg:gcd`` | 2 numbers in 1-20 | 2 in 1-100 | 2 in 1-1000 | 3 in 1-1000 | 3-4 in 1-10000 |
| ``rg:lcm`` | 2 numbers in 1-20 | 2 in 1-50 | 2 in 1-100 | 3 in 1-100 | 3-4 in 1-1000 |
| ``arith`` | 2 terms, 1 digit, + - | 2 terms, 1 digit, + - * | 2 terms, 2 digits, + - * | 3 terms, 2 digits, + - * | 3 terms, 3 digits, + - *, at most one * |

Low levels have small problem spaces (``rg:lcm`` level 1 holds ~210 distinct problems,
``arith`` level 1 holds 162), and a set never repeats a problem: asking for more than
a split holds raises ``DataError`` with the number found.

(fraction_simplification always uses the ``plain`` ``a/b`` style, so the knob is not
confounded with LaTeX formatting; a factor of at least 2 makes every fraction reducible.)

``arith`` is our own family for the CPU demo: integer ``+``, ``-``, ``*`` on operands
of exactly ``d`` digits (1-digit operands are 1-9), normal precedence. Besides the
problem (``"What is 12 + 7 * 3?"``, under 40 chars) it writes a short worked solution
(``"7 * 3 = 21; 12 + 21 = 33. \\boxed{33}"``, under 60 chars) into
``metadata["solution"]`` for supervised warm-up of the demo's base policy.

Determinism and splits: a source is a pure function of ``(difficulty, seed, split)``.
Candidates are drawn from a stream seeded by ``sha256(name, difficulty, seed)`` (not
``seed`` itself: reasoning-gym seeds item ``i`` with ``seed + i``, so seeds 1 and 2
would share all but one item). Each candidate has a *content key* (the expression,
the equation with its variable renamed, the sorted numbers, ...) that ignores the
generator's choice of wording. A candidate belongs to ``train`` / ``validation`` /
``test`` when the hash of its normalized content key falls in ``[0, 0.9)`` /
``[0.9, 0.95)`` / ``[0.95, 1)``, so one problem is never in two splits, whatever the
seed or difficulty. Within a set, candidates whose content key was already taken are
skipped (counted as duplicates in the report). Generation is sequential, so the first
``k`` prompts of a set of size ``n`` are the set of size ``k``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.data.loaders import normalize_text
from pipeline.data.records import DataError, LoadReport, Prompt

NUM_DIFFICULTY_LEVELS = 5
SPLIT_FRACTIONS: dict[str, float] = {"train": 0.90, "validation": 0.05, "test": 0.05}
SPLITS: tuple[str, ...] = tuple(SPLIT_FRACTIONS)
# A set is declared exhausted after this many draws in a row add nothing new; at the
# smallest split (5%) a space with many untaken problems left misses this often with
# probability ~1e-223.
MAX_CONSECUTIVE_MISSES = 10_000

ARITH_MAX_PROBLEM_CHARS = 40
ARITH_MAX_SOLUTION_CHARS = 60


@dataclass(frozen=True, slots=True)
class Draft:
    """A generated problem before it is split, deduplicated and given an id."""

    problem: str
    answer: str
    content_key: str
    metadata: dict[str, Any]


def _hash_unit_interval(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:13], 16) / 16**13


def split_of(content_key: str) -> str:
    """The split (``train``/``validation``/``test``) a problem belongs to, from its content key."""
    position = _hash_unit_interval("split\n" + normalize_text(content_key))
    cumulative = 0.0
    for split, fraction in SPLIT_FRACTIONS.items():
        cumulative += fraction
        if position < cumulative:
            return split
    return SPLITS[-1]


def _stream_seed(name: str, difficulty: int, seed: int) -> int:
    return int(hashlib.sha256(f"{name}|{difficulty}|{seed}".encode()).hexdigest()[:8], 16)


# ----------------------------------------------------------------------------- arith

@dataclass(frozen=True, slots=True)
class _ArithLevel:
    num_terms: int
    num_digits: int
    operators: tuple[str, ...]
    max_multiplications: int


ARITH_LEVELS: tuple[_ArithLevel, ...] = (
    _ArithLevel(num_terms=2, num_digits=1, operators=("+", "-"), max_multiplications=1),
    _ArithLevel(num_terms=2, num_digits=1, operators=("+", "-", "*"), max_multiplications=1),
    _ArithLevel(num_terms=2, num_digits=2, operators=("+", "-", "*"), max_multiplications=1),
    _ArithLevel(num_terms=3, num_digits=2, operators=("+", "-", "*"), max_multiplications=2),
    # Two products of 3-digit numbers would not fit a 60-char worked solution.
    _ArithLevel(num_terms=3, num_digits=3, operators=("+", "-", "*"), max_multiplications=1),
)
assert len(ARITH_LEVELS) == NUM_DIFFICULTY_LEVELS


def _apply(left: int, operator: str, right: int) -> int:
    if operator == "+":
        return left + right
    if operator == "-":
        return left - right
    assert operator == "*", operator
    return left * right


def arith_worked_solution(operands: list[int], operators: list[str]) -> tuple[int, str]:
    """``(answer, solution)`` for ``operands[0] op operators[0] operands[1] ...``.

    Products are worked first, then sums and differences left to right, one step per
    binary operation: ``[12, 7, 3], ["+", "*"]`` → ``(33, "7 * 3 = 21; 12 + 21 = 33. \\boxed{33}")``.
    """
    assert len(operands) == len(operators) + 1 >= 2
    values, pending, steps = list(operands), list(operators), []
    for precedence in (("*",), ("+", "-")):
        index = 0
        while index < len(pending):
            if pending[index] not in precedence:
                index += 1
                continue
            left, right = values[index], values[index + 1]
            result = _apply(left, pending[index], right)
            steps.append(f"{left} {pending[index]} {right} = {result}")
            values[index : index + 2] = [result]
            del pending[index]
    assert len(values) == 1 and not pending
    return values[0], "; ".join(steps) + f". \\boxed{{{values[0]}}}"


def _arith_drafts(difficulty: int, stream_seed: int) -> Iterator[Draft]:
    level = ARITH_LEVELS[difficulty - 1]
    rng = random.Random(stream_seed)
    low, high = 10 ** (level.num_digits - 1), 10**level.num_digits - 1
    while True:
        operands = [rng.randint(low, high) for _ in range(level.num_terms)]
        operators = [rng.choice(level.operators) for _ in range(level.num_terms - 1)]
        if operators.count("*") > level.max_multiplications:
            continue
        expression = " ".join(
            token for pair in zip(map(str, operands), [*operators, ""]) for token in pair if token
        )
        answer, solution = arith_worked_solution(operands, operators)
        problem = f"What is {expression}?"
        assert len(problem) < ARITH_MAX_PROBLEM_CHARS and len(solution) < ARITH_MAX_SOLUTION_CHARS, (
            problem,
            solution,
        )
        yield Draft(
            problem=problem,
            answer=str(answer),
            content_key=expression,
            metadata={
                "solution": solution,
                "num_terms": level.num_terms,
                "num_digits": level.num_digits,
            },
        )


# ----------------------------------------------------------------------- reasoning-gym

RG_DIFFICULTY_CONFIGS: dict[str, tuple[dict[str, Any], ...]] = {
    "basic_arithmetic": (
        dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
             allow_parentheses=False, allow_negation=False),
        dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1, operators=("+", "-", "*"),
             allow_parentheses=False, allow_negation=False),
        dict(min_terms=3, max_terms=3, min_digits=1, max_digits=2, operators=("+", "-", "*"),
             allow_parentheses=True, allow_negation=False),
        dict(min_terms=3, max_terms=4, min_digits=2, max_digits=2, operators=("+", "-", "*", "/"),
             allow_parentheses=True, allow_negation=True),
        dict(min_terms=4, max_terms=6, min_digits=2, max_digits=3, operators=("+", "-", "*", "/"),
             allow_parentheses=True, allow_negation=True),
    ),
    "chain_sum": (
        dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
        dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
        dict(min_terms=3, max_terms=4, min_digits=2, max_digits=2),
        dict(min_terms=4, max_terms=5, min_digits=2, max_digits=3),
        dict(min_terms=5, max_terms=6, min_digits=3, max_digits=4),
    ),
    "simple_equations": (
        dict(min_terms=2, max_terms=2, min_value=1, max_value=10, operators=("+", "-"),
             operators_weights=[0.5, 0.5]),
        dict(min_terms=2, max_terms=3, min_value=1, max_value=20, operators=("+", "-"),
             operators_weights=[0.5, 0.5]),
        dict(min_terms=2, max_terms=3, min_value=1, max_value=50, operators=("+", "-", "*"),
             operators_weights=[0.4, 0.4, 0.2]),
        dict(min_terms=3, max_terms=4, min_value=1, max_value=100, operators=("+", "-", "*"),
             operators_weights=[0.4, 0.4, 0.2]),
        dict(min_terms=4, max_terms=5, min_value=1, max_value=1000, operators=("+", "-", "*"),
             operators_weights=[0.4, 0.4, 0.2]),
    ),
    "fraction_simplification": tuple(
        dict(min_value=1, max_value=max_value, min_factor=2, max_factor=max_factor, styles=("plain",))
        for max_value, max_factor in ((10, 5), (20, 10), (100, 20), (1000, 100), (10_000, 1000))
    ),
    "gcd": tuple(
        dict(min_numbers=min_numbers, max_numbers=max_numbers, min_value=1, max_value=max_value)
        for min_numbers, max_numbers, max_value in ((2, 2, 20), (2, 2, 100), (2, 2, 1000), (3, 3, 1000), (3, 4, 10_000))
    ),
    "lcm": tuple(
        dict(min_numbers=min_numbers, max_numbers=max_numbers, min_value=1, max_value=max_value)
        for min_numbers, max_numbers, max_value in ((2, 2, 20), (2, 2, 50), (2, 2, 100), (3, 3, 100), (3, 4, 1000))
    ),
}
assert all(len(levels) == NUM_DIFFICULTY_LEVELS for levels in RG_DIFFICULTY_CONFIGS.values())


def _sorted_numbers(metadata: Mapping[str, Any]) -> str:
    # gcd/lcm do not depend on the order of their arguments.
    return ",".join(map(str, sorted(metadata["numbers"])))


# Per generator, what makes two items the same problem regardless of wording.
RG_CONTENT_KEYS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "basic_arithmetic": lambda metadata: metadata["expression"],
    "chain_sum": lambda metadata: metadata["expression"],
    "simple_equations": lambda metadata: metadata["equation"].replace(metadata["variable"], "x"),
    "fraction_simplification": lambda metadata: f"{metadata['numerator']}/{metadata['denominator']}",
    "gcd": _sorted_numbers,
    "lcm": _sorted_numbers,
}
assert RG_CONTENT_KEYS.keys() == RG_DIFFICULTY_CONFIGS.keys()

# reasoning-gym metadata we drop: bookkeeping, or its own (range-valued) difficulty record.
_RG_DROPPED_METADATA = frozenset({"source_dataset", "source_index", "difficulty"})


def _rg_drafts(generator: str, difficulty: int, stream_seed: int) -> Iterator[Draft]:
    import reasoning_gym  # takes ~1 s; only synthetic rg sources need it

    # Items are generated on demand by index, so the virtual size is only an upper bound.
    dataset = reasoning_gym.create_dataset(
        generator, size=2**31 - 1, seed=stream_seed, **RG_DIFFICULTY_CONFIGS[generator][difficulty - 1]
    )
    content_key = RG_CONTENT_KEYS[generator]
    for index in range(dataset.size):
        item = dataset[index]
        metadata = {
            key: value
            for key, value in item["metadata"].items()
            if key not in _RG_DROPPED_METADATA and isinstance(value, (str, int, float, bool))
        }
        yield Draft(
            problem=item["question"],
            answer=str(item["answer"]),
            content_key=content_key(item["metadata"]),
            metadata={**metadata, "rg_index": index},
        )


# -------------------------------------------------------------------------- registry

@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticSource:
    """A seeded generator of problems with a single difficulty knob ``1..num_levels``."""

    name: str
    description: str
    drafts: Callable[[int, int], Iterator[Draft]]  # (difficulty, stream_seed) -> endless drafts
    num_levels: int = NUM_DIFFICULTY_LEVELS


def _rg_source(generator: str) -> SyntheticSource:
    def drafts(difficulty: int, stream_seed: int) -> Iterator[Draft]:
        return _rg_drafts(generator, difficulty, stream_seed)

    return SyntheticSource(
        name=f"rg:{generator}", description=f"reasoning-gym {generator!r} generator", drafts=drafts
    )


SYNTHETIC_SOURCES: dict[str, SyntheticSource] = {
    "arith": SyntheticSource(
        name="arith",
        description="integer + - * on 1-3 digit numbers, with worked solutions (CPU demo)",
        drafts=_arith_drafts,
    ),
    **{f"rg:{generator}": _rg_source(generator) for generator in RG_DIFFICULTY_CONFIGS},
}


def generate_synthetic(
    name: str,
    *,
    difficulty: int,
    size: int,
    seed: int = 0,
    split: str = "train",
) -> tuple[list[Prompt], LoadReport]:
    """``size`` distinct prompts of source ``name`` at ``difficulty``, all in ``split``.

    Ids are ``"<name>/<16 hex digits of the problem text's hash>"``; metadata carries
    ``difficulty``, ``split``, ``seed`` and the generator's own fields. Raises
    ``DataError`` (a ``UserError``: the CLI prints one ``error:`` line, not a traceback) for an
    unknown name/split, a difficulty outside ``1..num_levels``, or when the source has fewer than
    ``size`` distinct problems in that split: each is a spec a user wrote.
    """
    if name not in SYNTHETIC_SOURCES:
        raise DataError(f"unknown synthetic source {name!r}; known: {sorted(SYNTHETIC_SOURCES)}")
    source = SYNTHETIC_SOURCES[name]
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 1 <= difficulty <= source.num_levels:
        raise DataError(f"{name}: difficulty must be an integer in 1..{source.num_levels}, got {difficulty!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DataError(f"{name}: size must be a non-negative integer, got {size!r}")
    if split not in SPLIT_FRACTIONS:
        raise DataError(f"{name}: unknown split {split!r}; synthetic sources have {list(SPLITS)}")

    report = LoadReport(source=name)
    prompts: list[Prompt] = []
    taken_keys: set[str] = set()
    num_misses = 0
    drafts = source.drafts(difficulty, _stream_seed(name, difficulty, seed))
    while len(prompts) < size:
        draft = next(drafts)
        report.num_rows += 1
        key = normalize_text(draft.content_key)
        if split_of(key) != split:
            report.num_other_split += 1
            num_misses += 1
        elif key in taken_keys:
            report.num_duplicates += 1
            num_misses += 1
        else:
            taken_keys.add(key)
            num_misses = 0
            problem_hash = hashlib.sha256(draft.problem.encode()).hexdigest()[:16]
            prompts.append(
                Prompt(
                    id=f"{name}/{problem_hash}",
                    problem=draft.problem,
                    answer=draft.answer,
                    source=name,
                    metadata={**draft.metadata, "difficulty": difficulty, "split": split, "seed": seed},
                )
            )
        if num_misses >= MAX_CONSECUTIVE_MISSES:
            raise DataError(
                f"{name} at difficulty {difficulty} has only about {len(prompts)} distinct problems in split "
                f"{split!r}, not {size} ({MAX_CONSECUTIVE_MISSES} draws in a row found nothing new); ask for "
                f"size <= {len(prompts)} or a higher difficulty"
            )
    report.num_kept = len(prompts)
    report.check_balanced()
    return prompts, report
