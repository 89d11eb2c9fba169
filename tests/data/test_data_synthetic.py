"""Synthetic sources: determinism, disjoint splits, difficulty monotone, arith worked solutions."""

import re
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.data.answers import last_boxed
from pipeline.data.loaders import normalize_text
from pipeline.data.synthetic import (
    ARITH_MAX_PROBLEM_CHARS,
    ARITH_MAX_SOLUTION_CHARS,
    NUM_DIFFICULTY_LEVELS,
    RG_CONTENT_KEYS,
    SPLIT_FRACTIONS,
    SYNTHETIC_SOURCES,
    arith_worked_solution,
    generate_synthetic,
    split_of,
)

RG_SOURCES = sorted(name for name in SYNTHETIC_SOURCES if name.startswith("rg:"))


def test_registry_has_the_requested_generators():
    assert set(SYNTHETIC_SOURCES) == {
        "arith",
        "rg:basic_arithmetic",
        "rg:chain_sum",
        "rg:simple_equations",
        "rg:fraction_simplification",
        "rg:gcd",
        "rg:lcm",
    }


@pytest.mark.parametrize("name", sorted(SYNTHETIC_SOURCES))
def test_deterministic_by_seed(name):
    first, _ = generate_synthetic(name, difficulty=3, size=40, seed=11)
    again, _ = generate_synthetic(name, difficulty=3, size=40, seed=11)
    other, _ = generate_synthetic(name, difficulty=3, size=40, seed=12)
    assert first == again
    assert [p.problem for p in first] != [p.problem for p in other]
    # reasoning-gym seeds item i with seed + i; seeds 11 and 12 must not be a shifted copy.
    assert len({p.problem for p in first} & {p.problem for p in other}) < 10


@pytest.mark.parametrize("name", sorted(SYNTHETIC_SOURCES))
def test_prompts_are_well_formed(name):
    prompts, report = generate_synthetic(name, difficulty=4, size=30, seed=0, split="validation")
    assert len(prompts) == 30 and report.num_kept == 30
    report.check_balanced()
    assert len({p.id for p in prompts}) == 30
    for prompt in prompts:
        assert prompt.source == name and prompt.id.startswith(f"{name}/")
        assert prompt.problem and prompt.answer
        assert prompt.metadata["difficulty"] == 4 and prompt.metadata["split"] == "validation"


def test_prefix_property_first_k_of_n_is_the_set_of_size_k():
    large, _ = generate_synthetic("rg:chain_sum", difficulty=3, size=50, seed=5)
    small, _ = generate_synthetic("rg:chain_sum", difficulty=3, size=20, seed=5)
    assert large[:20] == small


@pytest.mark.parametrize("name", sorted(SYNTHETIC_SOURCES))
def test_splits_are_disjoint(name):
    difficulty = 3
    keys_by_split = {}
    for split in SPLIT_FRACTIONS:
        for seed in (0, 1):
            prompts, _ = generate_synthetic(name, difficulty=difficulty, size=25, seed=seed, split=split)
            keys_by_split.setdefault(split, set()).update(normalize_text(p.problem) for p in prompts)
    train, validation, test = keys_by_split["train"], keys_by_split["validation"], keys_by_split["test"]
    assert not (train & validation) and not (train & test) and not (validation & test)


def test_split_is_by_content_not_wording():
    # simple_equations words the same equation several ways and picks a variable letter;
    # its content key ignores both, so a rewording cannot leak an equation across splits.
    content_key = RG_CONTENT_KEYS["simple_equations"]
    assert content_key({"equation": "3*k + 2 = 11", "variable": "k"}) == content_key(
        {"equation": "3*y + 2 = 11", "variable": "y"}
    )
    assert RG_CONTENT_KEYS["gcd"]({"numbers": [12, 8]}) == RG_CONTENT_KEYS["gcd"]({"numbers": [8, 12]})


def test_split_fractions_are_respected():
    counts = {split: 0 for split in SPLIT_FRACTIONS}
    for index in range(20_000):
        counts[split_of(f"{index} + {index}")] += 1
    for split, fraction in SPLIT_FRACTIONS.items():
        assert abs(counts[split] / 20_000 - fraction) < 0.01, (split, counts)


def test_no_duplicate_problems_within_a_set():
    prompts, report = generate_synthetic("arith", difficulty=2, size=150, seed=0)
    assert len({normalize_text(p.problem) for p in prompts}) == 150
    assert report.num_duplicates > 0  # the 243-problem space forces repeats among the draws


def test_exhausted_space_raises_with_the_number_found():
    # arith level 1 has 9 * 9 * 2 = 162 problems; about 8 hash into the 5% test split.
    with pytest.raises(ValueError, match=r"arith at difficulty 1 has only about \d+ distinct problems in split 'test'"):
        generate_synthetic("arith", difficulty=1, size=100, split="test")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "rg:nope", "difficulty": 1, "size": 1}, r"unknown synthetic source 'rg:nope'; known: \['arith'"),
        ({"name": "arith", "difficulty": 0, "size": 1}, r"difficulty must be an integer in 1..5"),
        ({"name": "arith", "difficulty": 6, "size": 1}, r"difficulty must be an integer in 1..5"),
        ({"name": "arith", "difficulty": 1, "size": -1}, r"size must be a non-negative integer"),
        ({"name": "arith", "difficulty": 1, "size": 1, "split": "dev"}, r"unknown split 'dev'"),
    ],
)
def test_bad_arguments(kwargs, message):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=message):
        generate_synthetic(name, **kwargs)


def _mean_digits(name: str, difficulty: int) -> float:
    prompts, _ = generate_synthetic(name, difficulty=difficulty, size=100, seed=3)
    return statistics.fmean(sum(char.isdigit() for char in p.problem + p.answer) for p in prompts)


@pytest.mark.parametrize("name", sorted(SYNTHETIC_SOURCES))
def test_difficulty_is_monotone_in_digits(name):
    # The number of digits in problem + answer (operand sizes, term counts, answer size)
    # must grow strictly with the knob for every source.
    means = [_mean_digits(name, difficulty) for difficulty in range(1, NUM_DIFFICULTY_LEVELS + 1)]
    assert all(lower < higher for lower, higher in zip(means, means[1:])), means


# ---------------------------------------------------------------------------- arith


def _reference_value(operands: list[int], operators: list[str]) -> int:
    """Standard precedence, evaluated as a sum of signed products (independent of the worked steps)."""
    total, product, sign = 0, operands[0], 1
    for operator, operand in zip(operators, operands[1:]):
        if operator == "*":
            product *= operand
        else:
            total += sign * product
            sign, product = (1 if operator == "+" else -1), operand
    return total + sign * product


def _check_worked_solution(solution: str, answer: str) -> None:
    assert last_boxed(solution) == answer
    steps = solution.rsplit(". \\boxed", 1)[0].split("; ")
    for step in steps:
        left, operator, right, result = re.fullmatch(r"(-?\d+) ([+*-]) (-?\d+) = (-?\d+)", step).groups()
        left, right, result = int(left), int(right), int(result)
        assert result == {"+": left + right, "-": left - right, "*": left * right}[operator]


def test_arith_worked_solution_hand_cases():
    # 12 + 7 * 3: the product first (21), then 12 + 21 = 33.
    assert arith_worked_solution([12, 7, 3], ["+", "*"]) == (33, "7 * 3 = 21; 12 + 21 = 33. \\boxed{33}")
    # 9 - 4 - 2 is left-associative: 5, then 3 (not 9 - 2 = 7).
    assert arith_worked_solution([9, 4, 2], ["-", "-"]) == (3, "9 - 4 = 5; 5 - 2 = 3. \\boxed{3}")
    # 5 - 6 * 7 = 5 - 42 = -37.
    assert arith_worked_solution([5, 6, 7], ["-", "*"]) == (-37, "6 * 7 = 42; 5 - 42 = -37. \\boxed{-37}")
    assert arith_worked_solution([2, 3, 4], ["*", "*"]) == (24, "2 * 3 = 6; 6 * 4 = 24. \\boxed{24}")


@given(
    operands=st.lists(st.integers(1, 999), min_size=2, max_size=4),
    operators=st.lists(st.sampled_from(["+", "-", "*"]), min_size=3, max_size=3),
)
def test_arith_worked_solution_matches_reference(operands, operators):
    operators = operators[: len(operands) - 1]
    answer, solution = arith_worked_solution(operands, operators)
    assert answer == _reference_value(operands, operators)
    _check_worked_solution(solution, str(answer))


@pytest.mark.parametrize("difficulty", range(1, NUM_DIFFICULTY_LEVELS + 1))
def test_arith_problems_and_solutions_are_short_and_correct(difficulty):
    size = {1: 120, 2: 200}.get(difficulty, 400)  # levels 1 and 2 hold 162 and 243 problems
    prompts, _ = generate_synthetic("arith", difficulty=difficulty, size=size, seed=difficulty)
    for prompt in prompts:
        assert len(prompt.problem) < ARITH_MAX_PROBLEM_CHARS == 40
        assert len(prompt.metadata["solution"]) < ARITH_MAX_SOLUTION_CHARS == 60
        tokens = re.fullmatch(r"What is (.*)\?", prompt.problem).group(1).split(" ")
        operands, operators = [int(token) for token in tokens[::2]], tokens[1::2]
        assert len(operands) == prompt.metadata["num_terms"]
        assert all(len(str(operand)) == prompt.metadata["num_digits"] for operand in operands)
        assert prompt.answer == str(_reference_value(operands, operators))
        _check_worked_solution(prompt.metadata["solution"], prompt.answer)


def test_arith_worst_case_lengths_fit():
    # The longest level-5 problem/solution: one product of two 3-digit numbers, then a subtraction.
    answer, solution = arith_worked_solution([100, 999, 999], ["-", "*"])
    assert solution == "999 * 999 = 998001; 100 - 998001 = -997901. \\boxed{-997901}"
    assert len(solution) < 60 and len("What is 100 - 999 * 999?") < 40
    # Level 4 allows two products of 2-digit numbers.
    _, solution = arith_worked_solution([99, 99, 99], ["*", "*"])
    assert len(solution) < 60
