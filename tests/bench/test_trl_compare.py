"""tools/bench/trl_compare.py's TRL dataset: the exported tokenizer encodes every prompt row to winnow's ids.

TRL tokenizes a text prompt as ``tokenizer(text=prompts)`` (special tokens added by the
tokenizer's own settings); the demo tokenizer prepends ``<bos>`` itself, so a row that also
carried it would start with two. No TRL needed: the writer checks the ids with the exported
tokenizer TRL would load. Runtime: one spawned rank, the session's tiny bootstrap (~10 s
when not cached yet) and its export, ~15-25 s on 2 cores.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed_utils import run_distributed
from tests.stages.test_bootstrap import OVERRIDES as BOOTSTRAP_OVERRIDES
from tools.bench import trl_compare

ROUNDS, STEPS_PER_ROUND, PROMPTS = 1, 2, 3


def _export_and_write_worker(rank, world_size, tmp, cache):
    from pathlib import Path

    from pipeline.parallel.context import ParallelContext

    out = Path(tmp)
    args = trl_compare.parse_args([
        "--rounds", str(ROUNDS), "--steps-per-round", str(STEPS_PER_ROUND), "--prompts", str(PROMPTS),
        "--group-size", "2", "--new-tokens", "8", "--eval-prompts", "0", "--out", str(out),
        "--winnow", "trainer.old_logprobs=update_forward", *[f"bootstrap.{o}" for o in BOOTSTRAP_OVERRIDES],
        f"bootstrap.cache_dir={cache}",
    ])
    cfg = trl_compare.winnow_config(args, out)
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0)
    base = trl_compare.export_base_policy(cfg, context=context, directory=out / "base_hf")
    rows = trl_compare.write_prompt_stream(cfg, tokenizer=base.tokenizer, hf_dir=out / "base_hf",
                                           path=out / "prompts.jsonl")
    # The same writer once more, the row text carrying the BOS string as it used to: the check must refuse it.
    import pipeline.data

    render = pipeline.data.render_prompt
    pipeline.data.render_prompt = lambda *a, **k: base.tokenizer.bos_token + render(*a, **k)
    try:
        trl_compare.write_prompt_stream(cfg, tokenizer=base.tokenizer, hf_dir=out / "base_hf",
                                        path=out / "with_bos.jsonl")
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    finally:
        pipeline.data.render_prompt = render
    context.destroy()
    return rows, cfg.steps, cfg.prompts_per_step, base.tokenizer.bos_token, refusal


@pytest.fixture(scope="module")
def written(tmp_path_factory, bootstrap_cache_dir):
    tmp = tmp_path_factory.mktemp("trl_compare")
    (result,) = run_distributed(_export_and_write_worker, world_size=1, args=(str(tmp), str(bootstrap_cache_dir)),
                                timeout_s=300)
    return tmp, result


def test_every_prompt_row_encodes_to_winnows_prompt_ids_through_the_exported_tokenizer(written):
    from transformers import AutoTokenizer

    tmp, (rows, steps, prompts_per_step, bos, _) = written
    assert (steps, prompts_per_step) == (ROUNDS * STEPS_PER_ROUND, PROMPTS)
    assert rows == steps * prompts_per_step
    lines = [json.loads(line) for line in (tmp / "prompts.jsonl").read_text().splitlines()]
    assert len(lines) == rows and all(line["answer"] for line in lines)
    exported = AutoTokenizer.from_pretrained(tmp / "base_hf", trust_remote_code=False)
    for line in lines:
        assert not line["prompt"].startswith(bos)  # the exported tokenizer adds it
        ids = exported(text=[line["prompt"]])["input_ids"][0]  # what TRL feeds its model
        assert ids[0] == exported.bos_token_id and ids[1] != exported.bos_token_id


def test_a_row_that_would_encode_differently_is_refused(written):
    _, (_, _, _, _, refusal) = written
    assert refusal is not None and "TRL would encode" in refusal and "different prompts" in refusal
