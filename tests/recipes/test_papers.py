"""Paper presets: valid, YAML round-trip, differ from their baseline only where documented, match the tables.

Runtime: ~20 s on the shared 2-core machine, mostly imports (83 presets; no model is built).
"""

import re

import pytest
import yaml

from pipeline import cli, configlib
from pipeline.algorithms.e3 import e3_budget_bounds
from pipeline.cli.presets import main as presets_main
from pipeline.config import RLConfig
from pipeline.data.sources import parse_spec
from pipeline.rl.methods import D3S_SCHEDULE, build_methods
from pipeline.rl.registry import MethodSetting
from recipes import papers
from recipes.papers import MODELS, PAPER_PRESETS, build, write_yaml
from tests.recipes.test_cpu_recipes import _flat

RUN_DIR_KEYS = {"logging.output_dir", "checkpoint.directory"}
QWEN_VOCAB = 151_936  # only sizes the E3 controller's Eq. 4 constant here




def _changed(child: str, parent: str) -> set[str]:
    child_values, parent_values = _flat(build(child)), _flat(build(parent))
    return {key for key in child_values if child_values[key] != parent_values[key]} - RUN_DIR_KEYS


def _split(name: str) -> tuple[str, str]:
    """``d3s_i_llama31_8b_instruct`` → (``d3s_i``, ``llama31_8b_instruct``)."""
    model = max((key for key in MODELS if name.endswith(f"_{key}")), key=len)
    return name[: -len(model) - 1], model


def _alg(*names: str) -> set[str]:
    return {f"algorithm.{name}" for name in names}


# method (regex over the name without its model) → (parent method, the keys its docstring says it changes).
# Table 3's rows each move some of the four schedule values away from Table 6: a non-empty subset.
TABLE_3_ROW = r"d3s_n\d+to\d+_k\d+to\d+"
DERIVED = {
    r"gspo_n32": ("grpo_n32", _alg("loss")),
    r"pods": ("grpo_n32", _alg("sample_selector")),  # pods.num_keep's default is D³S's N_init, 8
    r"gspo_pods": ("gspo_n32", _alg("sample_selector")),
    r"d3s": ("grpo_n32", _alg("sample_selector", "token_weights", "aggregation")),
    r"gspo_d3s": ("gspo_n32", _alg("sample_selector", "token_weights", "aggregation")),
    r"d3s_i": ("grpo_n32", _alg("sample_selector", "token_weights", "aggregation")),
    r"d1s|d1s_c": ("grpo_n32", _alg("sample_selector", "aggregation", "d3s.dynamic")),
    r"d2s": ("grpo_n32", _alg("sample_selector", "token_weights", "aggregation", "d3s.dynamic")),
    TABLE_3_ROW: ("d3s", _alg("d3s.num_keep_init", "d3s.num_keep_final", "d3s.keep_ratio_init",
                                              "d3s.keep_ratio_final")),
    r"grpo_n(8|16)": ("grpo_n4", {"group_size"}),
    r"dapo_n4": ("grpo_n4", _alg("sampling")),
    r"ada_seq_pos": ("grpo_n4", _alg("sampling", "advantage", "baseline_weight", "ada_seq.exit_rule", "ada_seq.k_pos",
                                     "ada_seq.k_neg", "ada_seq.round_size")),
    r"ada_seq_balance": ("grpo_n4", _alg("sampling", "advantage", "baseline_weight", "ada_seq.round_size")),
    r"ada_est": ("grpo_n4", {"group_size"} | _alg("budget", "advantage", "baseline_weight")),
    r"ada_seq_balance_d3s_cw": ("ada_seq_balance", _alg("sample_selector", "token_weights", "aggregation",
                                                        "d3s.num_keep_init", "d3s.num_keep_final")),
    r"dapo_n8": ("grpo_n8", _alg("sampling", "eps_high")),
    r"e3_er": ("grpo_n8", _alg("entropy_coef")),
    r"e3_dr": ("grpo_n8", _alg("budget")),
    r"e3_ts|e3_ts_an": ("grpo_n8", _alg("temperature", "e3.anneal_start_fraction")),
    r"e3": ("grpo_n8", _alg("budget", "temperature", "e3.anneal_start_fraction")),
    r"depo": ("grpo_n8", _alg("prompt_filter", "depo.encoder", "depo.warmup_steps")),
    r"depo_no_rank": ("depo", _alg("depo.w_rank")),
    r"depo_no_distill": ("depo", _alg("depo.w_distill")),
    r"depo_clip_higher": ("depo", _alg("eps_high")),
    r"cw_grpo": ("grpo_n12", _alg("token_weights")),
}
BASELINE_RECIPES = {papers.d3s_baseline, papers.ada_baseline, papers.e3_baseline, papers.depo_baseline,
                    papers.cw_baseline}


def _is_root(name: str) -> bool:
    preset = PAPER_PRESETS[name]
    return preset.recipe in BASELINE_RECIPES and preset.options.get("loss", "grpo") == "grpo" \
        and preset.options.get("group_size", 4) == 4


def _derived_cases():
    for name in PAPER_PRESETS:
        if _is_root(name):
            continue
        method, model = _split(name)
        rules = [rule for pattern, rule in DERIVED.items() if re.fullmatch(pattern, method)]
        parent, keys = rules[0] if len(rules) == 1 else (None, None)
        yield pytest.param(name, parent and f"{parent}_{model}", keys, re.fullmatch(TABLE_3_ROW, method) is None,
                           id=name)


@pytest.mark.parametrize("name", sorted(PAPER_PRESETS))
def test_every_preset_validates_and_round_trips_through_yaml(name, tmp_path):
    cfg = build(name)
    configlib.validate(cfg)
    assert cfg.policy is None and cfg.logging.output_dir == f"runs/papers/{name}"
    assert cfg.checkpoint.directory.startswith(cfg.logging.output_dir)
    path = write_yaml(name, tmp_path / f"{name}.yaml", policy="/models/x")
    loaded = configlib.load(RLConfig, yaml_path=path)
    assert loaded == build(name, policy="/models/x")
    assert loaded != cfg  # the policy travelled through the file
    for spec in (*cfg.data.train, cfg.eval_set):
        parse_spec(spec)  # every data source the presets name is one winnow knows


@pytest.mark.parametrize(("name", "parent", "keys", "exact"), list(_derived_cases()))
def test_preset_differs_from_its_baseline_only_where_documented(name, parent, keys, exact):
    assert parent is not None, f"{name}: no rule (or several) in DERIVED names its baseline"
    assert parent in PAPER_PRESETS
    changed = _changed(name, parent)
    assert changed == keys if exact else (changed and changed <= keys)


def test_winnow_loads_a_written_preset(tmp_path, capsys):
    path = write_yaml("d3s_qwen25_math_7b", tmp_path / "d3s.yaml")
    # `config show` takes its overrides before --config (argparse stops at the stage's positional)
    assert cli.main(["config", "show", "rl", "policy=/models/Qwen2.5-Math-7B", "--config", str(path)]) == 0
    shown = configlib.from_dict(RLConfig, yaml.safe_load(capsys.readouterr().out))
    assert shown == build("d3s_qwen25_math_7b", policy="/models/Qwen2.5-Math-7B")


def test_script_lists_and_writes(tmp_path, capsys):
    assert presets_main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(PAPER_PRESETS)
    assert presets_main(["cw_grpo_r1_distill_qwen_1p5b", str(tmp_path / "cw.yaml")]) == 0
    assert "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" in capsys.readouterr().out
    assert configlib.load(RLConfig, yaml_path=tmp_path / "cw.yaml").algorithm.token_weights == ["cw_grpo"]
    assert presets_main(["no_such_preset", str(tmp_path / "x.yaml")]) == 2
    assert "unknown paper preset 'no_such_preset'" in capsys.readouterr().err


def test_wrong_inputs_name_what_is_allowed():
    with pytest.raises(configlib.ConfigError, match="known presets: .*d3s_qwen25_math_7b"):
        build("d3s_qwen7b")
    with pytest.raises(ValueError, match=r"backbone: E3 uses \['r1_distill_qwen_1p5b'"):
        papers.e3_baseline(backbone="qwen25_math_7b")
    with pytest.raises(ValueError, match="anneal.*needs temperature=True"):
        papers.e3_method(backbone="r1_distill_qwen_7b", dynamic_budget=False, temperature=False, anneal=True)


# ------------------------------------------------------------------ numbers against the paper tables


def _methods(cfg):
    """The methods the loop would build for a preset (on Qwen's vocabulary)."""
    return build_methods(cfg.algorithm, MethodSetting(total_steps=cfg.steps, group_size=cfg.group_size,
                                                      temperature=cfg.temperature, vocab_size=QWEN_VOCAB))


@pytest.mark.parametrize(("model", "lr", "temperature", "top_p", "epochs"), [
    ("qwen25_math_7b", 5e-7, 1.0, 0.9, 1), ("qwen25_math_1p5b", 5e-7, 1.0, 0.9, 1),
    ("llama31_8b_instruct", 1e-8, 0.6, 0.9, 2), ("openmath2_llama31_8b", 2e-7, 0.7, 0.95, 2),
])
def test_d3s_tables_5_and_6(model, lr, temperature, top_p, epochs):
    cfg = build(f"d3s_{model}")
    assert (cfg.optim.lr, cfg.temperature, cfg.top_p) == (lr, temperature, top_p)  # Table 5
    assert cfg.steps == cfg.optim.total_steps == epochs * 630  # ⌈40,315 / 64⌉ steps per epoch
    assert cfg.group_size == 32 and (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (0.2, 0.2)  # Table 6
    schedule = _methods(cfg).shared[D3S_SCHEDULE].schedule
    assert schedule.value_at(0.0) == (8, 0.05) and schedule.value_at(1.0) == (32, 0.20)  # Table 6, Eq. 9
    assert build(f"grpo_n32_{model}").algorithm.aggregation == "seq_mean_token_mean"  # Eq. 1


def test_d3s_variants_hold_or_schedule_as_section_4_1_says():
    def schedule(name):
        cfg = build(name)
        return _methods(cfg).shared[D3S_SCHEDULE].schedule

    assert schedule("d1s_qwen25_math_7b").value_at(1.0) == (8, 0.05)  # no dynamic schedule
    assert schedule("d2s_qwen25_math_7b").value_at(1.0) == (8, 0.05)
    assert schedule("d3s_i_llama31_8b_instruct").value_at(1.0) == (32, 0.20)
    assert build("d1s_qwen25_math_7b").algorithm.sample_selector == "d3s_intra"
    assert build("d1s_c_qwen25_math_7b").algorithm.sample_selector == "d3s_cross"
    assert build("d3s_i_openmath2_llama31_8b").algorithm.sample_selector == "d3s_intra"
    assert build("d2s_llama31_8b_instruct").algorithm.token_weights == ["d3s_topk"]


def test_d3s_table_3_grid():
    rows = {(d.num_keep_init, d.num_keep_final, d.keep_ratio_init, d.keep_ratio_final)
            for name, preset in PAPER_PRESETS.items() if name.startswith("d3s_n")
            for d in [preset().algorithm.d3s]}
    assert rows == {(8, 16, 0.05, 0.2), (16, 32, 0.05, 0.2), (8, 32, 0.05, 0.3), (8, 32, 0.05, 0.4),
                    (8, 32, 0.05, 0.5), (8, 32, 0.1, 0.2), (8, 32, 0.1, 0.3), (8, 32, 0.1, 0.4), (8, 32, 0.1, 0.5)}


def test_pods_keeps_d3s_initial_subset_size():
    assert build("pods_qwen25_math_7b").algorithm.pods.num_keep == papers.D3S_NUM_KEEP[0] == 8


def test_the_loop_gives_pods_its_subset_size():
    methods = _methods(build("pods_qwen25_math_7b"))
    assert methods.sample_selector.schedule is None and D3S_SCHEDULE not in methods.shared
    assert methods.sample_selector.num_keep == 8


def test_reinforce_ada_section_4_1():
    cfg = build("ada_seq_balance_qwen25_math_1p5b")
    assert (cfg.prompts_per_step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.decay) == (512, 1e-6, 10, "constant")
    assert (cfg.algorithm.entropy_coef, cfg.algorithm.kl_coef) == (1e-4, 0.0)
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (0.2, 0.28)
    assert cfg.steps == 600 and cfg.temperature == 1.0 and cfg.group_size == 4
    seq = cfg.algorithm.ada_seq
    assert (seq.exit_rule, seq.k_pos, seq.k_neg, seq.max_samples) == ("balance", 2, 2, 32)  # n/2 each, N_max = 32
    pos = build("ada_seq_pos_qwen25_math_1p5b").algorithm.ada_seq
    assert (pos.exit_rule, pos.k_pos, pos.round_size) == ("pos", 1, 8)
    assert (cfg.algorithm.advantage, cfg.algorithm.baseline_weight) == ("global_baseline", "bernoulli_std")
    est = build("ada_est_qwen25_math_7b")
    assert est.group_size == 8 and est.algorithm.budget == "ada_est"  # the budget averages 8 per prompt
    assert est.algorithm.baseline_weight == "inv_sqrt_mean"  # Algorithm 1 lines 14-16
    assert [build(f"grpo_n{n}_qwen25_math_1p5b").group_size for n in (4, 8, 16)] == [4, 8, 16]


def test_e3_section_5_1_and_budget_widening():
    cfg = build("e3_r1_distill_qwen_7b")
    assert (cfg.prompts_per_step, cfg.group_size, cfg.steps, cfg.max_new_tokens) == (64, 8, 480, 6144)
    assert cfg.optim.lr == 2e-6 and build("e3_r1_distill_qwen_1p5b").optim.lr == 5e-6
    assert (cfg.algorithm.e3.anneal_start_fraction, cfg.algorithm.e3.eta) == (0.6, 0.9)
    temperature = _methods(cfg).temperature.scheduler
    assert (temperature.anneal_start, temperature.max_steps) == (288, 480)  # ⌊0.6 · t_max⌋
    assert build("e3_ts_r1_distill_qwen_7b").algorithm.e3.anneal_start_fraction is None
    budget = cfg.algorithm.e3_budget
    bounds = [e3_budget_bounds(num_completed_passes=passes, group_size=cfg.group_size, min_limit=budget.min_limit,
                               max_limit=budget.max_limit, step=budget.widen_step) for passes in range(3)]
    assert bounds == [(8, 8), (6, 10), (4, 12)]  # §5.4: G_max is G + 4 in the third epoch
    assert build("e3_er_r1_distill_qwen_1p5b").algorithm.entropy_coef == 1e-4  # §5.3


def test_depo_section_4_1():
    cfg = build("depo_qwen25_7b_instruct")
    assert (cfg.steps, cfg.prompts_per_step, cfg.optim.lr, cfg.group_size) == (1000, 128, 1e-6, 8)
    depo = cfg.algorithm.depo
    assert (depo.warmup_steps, depo.w_distill, depo.w_rank, depo.encoder) == (100, 0.5, 3.0, "minilm")
    assert build("depo_no_rank_qwen25_1p5b_instruct").algorithm.depo.w_rank == 0.0
    assert build("dapo_n8_qwen25_1p5b_instruct").algorithm.sampling == "dynamic"


def test_cw_grpo_appendix_c():
    cfg = build("cw_grpo_qwen25_math_7b_instruct")
    assert (cfg.optim.lr, cfg.steps, cfg.optim.warmup_steps) == (1e-6, 100, 10)  # warm-up ratio 0.1
    assert (cfg.group_size, cfg.max_new_tokens, cfg.temperature) == (12, 3072, 0.7)  # 4,096 positions hold the prompt too
    assert cfg.algorithm.token_weights == ["cw_grpo"] and cfg.algorithm.cw_grpo_scope == "group"


def test_combination_scales_d3s_to_the_update_group():
    algorithm = build("ada_seq_balance_d3s_cw_qwen25_math_7b").algorithm
    assert (algorithm.sampling, algorithm.ada_seq.exit_rule) == ("ada_seq", "balance")
    assert algorithm.token_weights == ["d3s_topk", "cw_grpo"] and algorithm.sample_selector == "d3s_cross"
    assert (algorithm.d3s.num_keep_init, algorithm.d3s.num_keep_final) == (2, 4)
