"""The curation artifact (``pipeline.stats.curation``): what the curate stage writes reads back exactly."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from pipeline.data import load_prompts
from pipeline.stats.curation import (
    FORMAT_VERSION,
    KEPT_FILE,
    MANIFEST_FILE,
    PASS_RATES_FILE,
    CurationError,
    CurationResult,
    load_curation,
    pass_rates,
    write_kept,
    write_manifest,
    write_pass_rates,
)


@dataclass
class _Prompt:
    id: str
    problem: str
    answer: str
    metadata: dict = field(default_factory=dict)


def _result(output_dir) -> CurationResult:
    num_samples = np.array([4, 0, 4, 4], dtype=np.int64)
    num_correct = np.array([4, 0, 1, 0], dtype=np.int64)
    return CurationResult(
        output_dir=output_dir, prompt_ids=["a", "b", "c", "d"], specs=["s1", "s1", "s2", "s2"],
        sources=["x", "x", "y", "y"], num_samples=num_samples, num_correct=num_correct,
        pass_rates=pass_rates(num_samples, num_correct), kept_mask=np.array([False, False, True, False]),
        drop_reasons=["trivial", "too_long", "", "impossible"], samples_per_prompt=4,
        counts={"total": 4, "trivial": 1, "too_long": 1, "impossible": 1, "kept": 1},
    )


def test_a_written_curation_reads_back_exactly(tmp_path):
    result = _result(tmp_path)
    write_pass_rates(tmp_path / PASS_RATES_FILE, result, difficulty=["easy", None, "hard", "impossible"])
    write_kept(tmp_path / KEPT_FILE, [_Prompt("c", "1+1?", "2", {"level": 3})])
    with pytest.raises(CurationError, match="no complete curation"):  # the manifest marks it complete
        load_curation(tmp_path)
    write_manifest(tmp_path, {"config": {"num_samples": 4}, "counts": result.counts})

    loaded = load_curation(tmp_path)
    assert json.loads((tmp_path / MANIFEST_FILE).read_text())["format"] == FORMAT_VERSION
    for name in ("prompt_ids", "specs", "sources", "drop_reasons", "samples_per_prompt", "counts", "output_dir"):
        assert getattr(loaded, name) == getattr(result, name), name
    for name in ("num_samples", "num_correct", "pass_rates", "kept_mask"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(result, name), err_msg=name)
    assert np.isnan(loaded.pass_rates[1]) and loaded.kept_ids == ["c"]
    kept, _ = load_prompts(str(loaded.kept_path))
    assert [(p.id, p.problem, p.answer, p.metadata) for p in kept] == [("c", "1+1?", "2", {"level": 3})]


def test_another_format_is_refused(tmp_path):
    result = _result(tmp_path)
    write_pass_rates(tmp_path / PASS_RATES_FILE, result, difficulty=[None] * 4)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT_VERSION - 1, "config": {"num_samples": 4},
                                                      "counts": result.counts}))
    with pytest.raises(CurationError, match=f"this version reads {FORMAT_VERSION}"):
        load_curation(tmp_path)


def test_the_difficulty_column_names_every_prompt(tmp_path):
    with pytest.raises(ValueError, match="3 names for 4 prompts"):
        write_pass_rates(tmp_path / PASS_RATES_FILE, _result(tmp_path), difficulty=[None] * 3)
