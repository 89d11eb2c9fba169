"""HF logits == megatron logits (fp32, max |diff| <= 1e-4) after conversion, TP/PP included.

The megatron side is ``pipeline.models.build_gpt_model`` (local layer spec on CPU). RoPE
settings are exercised with controls showing that a wrong theta or a dropped Llama-3
scaling moves the logits by far more than the tolerance, so parity is not vacuous.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.checkpoint.convert import copy_into_model, hf_to_megatron_state, megatron_to_hf_state
from pipeline.checkpoint.hf_io import HFCheckpointReader, write_hf_checkpoint
from pipeline.checkpoint.hf_map import MegatronLayout
from tests.checkpoint.tiny_models import LLAMA3_SCALING, build_hf_model, hf_saved_state, tiny_spec
from tests.distributed_utils import run_distributed

TOLERANCE = 1e-4
BATCH, SEQ_LEN = 2, 128  # long enough for Llama-3 scaling's medium band to rotate visibly


def _spec(family, *, tied, groups, theta, scaling=None):
    return tiny_spec(
        family,
        tie_embeddings=tied,
        num_query_groups=groups,
        hidden_size=64,  # head_dim 16 (Qwen3: 32): eight RoPE frequencies or more
        ffn_hidden_size=96,
        num_layers=2,
        rope_theta=theta,
        rope_scaling=scaling,
    )


PARITY_SPECS = {
    "llama-gqa-theta5e5": _spec("llama", tied=False, groups=2, theta=500000.0),
    "llama-tied-mha": _spec("llama", tied=True, groups=4, theta=10000.0),
    "qwen2-gqa-theta1e6": _spec("qwen2", tied=False, groups=2, theta=1e6),
    "qwen2-tied-mqa": _spec("qwen2", tied=True, groups=1, theta=1e6),
    "llama3-scaling-x8": _spec("llama", tied=False, groups=2, theta=500000.0, scaling=LLAMA3_SCALING),
    "llama3.2-scaling-x32": _spec("llama", tied=True, groups=2, theta=500000.0, scaling={**LLAMA3_SCALING, "factor": 32.0}),
    # Qwen3-4B's shape of attention scaled down: tied, GQA, heads wider than hidden / heads.
    "qwen3-tied-gqa-theta1e6": _spec("qwen3", tied=True, groups=2, theta=1e6),
}


def _batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(11))  # (B, T)
    position_ids = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)  # (B, T)
    # megatron's torch attention masks with masked_fill(mask, -10000): boolean, True = masked.
    causal_mask = torch.triu(torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool), diagonal=1)[None, None]  # (1, 1, T, T)
    return input_ids, position_ids, causal_mask


def _hf_logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits  # (B, T, V)


def _megatron_model(spec, hf_tensors):
    from pipeline.models.factory import build_gpt_model

    model = build_gpt_model(spec).eval()
    layout = MegatronLayout.build(spec)
    copy_into_model(model, hf_to_megatron_state(hf_tensors, spec=spec, layout=layout))
    return model


def _megatron_logits(model, spec) -> torch.Tensor:
    """On the CPU, wherever the model was built (compared with the HF model's CPU logits)."""
    device = next(model.parameters()).device
    input_ids, position_ids, causal_mask = (t.to(device) for t in _batch(spec.vocab_size))
    with torch.no_grad():
        return model(input_ids, position_ids, causal_mask).cpu()  # (B, T, V)


@pytest.mark.parametrize("name", list(PARITY_SPECS))
def test_megatron_logits_match_hf_logits(megatron_single_rank, name):
    spec = PARITY_SPECS[name]
    hf_model = build_hf_model(spec)
    expected = _hf_logits(hf_model, _batch(spec.vocab_size)[0])
    actual = _megatron_logits(_megatron_model(spec, hf_saved_state(hf_model, spec)), spec)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= TOLERANCE
    assert expected.abs().max().item() > 1.0  # O(1) logits: the tolerance is meaningful


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("llama3-scaling-x8", {"rope_scaling": None}),
        ("llama3.2-scaling-x32", {"rope_scaling": LLAMA3_SCALING}),
        ("qwen2-gqa-theta1e6", {"rope_theta": 10000.0}),
    ],
)
def test_rope_settings_reach_megatron(megatron_single_rank, name, wrong):
    spec = PARITY_SPECS[name]
    hf_model = build_hf_model(spec)
    expected = _hf_logits(hf_model, _batch(spec.vocab_size)[0])
    wrong_spec = dataclasses.replace(spec, **wrong)
    mismatched = _megatron_logits(_megatron_model(wrong_spec, hf_saved_state(hf_model, spec)), spec)
    assert (mismatched - expected).abs().max().item() > 100 * TOLERANCE


def test_megatron_rope_ignores_position_ids_unlike_hf(megatron_single_rank):
    # megatron-core 0.16.1 GPTModel computes RoPE for positions 0..T-1 from the sequence
    # length alone (position_ids only feed learned absolute embeddings); HF rotates by
    # position_ids. A uniform shift cancels in q.k (RoPE is relative), positions that
    # restart mid-row (left padding, packed documents) do not: those batches need megatron's
    # packed-sequence path or right padding.
    spec = PARITY_SPECS["llama-gqa-theta5e5"]
    hf_model = build_hf_model(spec)
    model = _megatron_model(spec, hf_saved_state(hf_model, spec))
    input_ids, _, causal_mask = _batch(spec.vocab_size)
    half = SEQ_LEN // 2
    restarting = torch.cat([torch.arange(half), torch.arange(SEQ_LEN - half)]).expand(BATCH, SEQ_LEN)  # (B, T)
    device = next(model.parameters()).device
    with torch.no_grad():
        megatron_restarting = model(input_ids.to(device), restarting.to(device), causal_mask.to(device)).cpu()
        hf_restarting = hf_model(input_ids, position_ids=restarting).logits
    assert torch.equal(megatron_restarting, _megatron_logits(model, spec))
    hf_default = _hf_logits(hf_model, input_ids)
    assert torch.equal(hf_restarting[:, :half], hf_default[:, :half])
    assert (hf_restarting[:, half:] - hf_default[:, half:]).abs().max().item() > 100 * TOLERANCE


def test_hf_folder_to_megatron_and_back_to_a_folder_transformers_loads(megatron_single_rank, tmp_path):
    from transformers import AutoModelForCausalLM

    spec = PARITY_SPECS["qwen2-gqa-theta1e6"]
    hf_model = build_hf_model(spec)
    hf_model.save_pretrained(tmp_path / "source", max_shard_size="40KB")
    reader = HFCheckpointReader.open(tmp_path / "source")
    assert reader.spec == spec
    model = _megatron_model(reader.spec, reader.get_tensor)
    layout = MegatronLayout.build(spec)
    exported = write_hf_checkpoint(
        tmp_path / "export",
        megatron_to_hf_state([[model.state_dict()]], spec=spec, layout=layout),
        spec=spec,
        max_shard_bytes=64 * 1024,
    )
    reloaded = AutoModelForCausalLM.from_pretrained(
        exported, local_files_only=True, dtype=torch.float32, attn_implementation="eager"
    )
    original = hf_saved_state(hf_model, spec)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    input_ids = _batch(spec.vocab_size)[0]
    assert torch.equal(_hf_logits(reloaded.eval(), input_ids), _hf_logits(hf_model, input_ids))


# --- TP = 2 and PP = 2 on two gloo ranks ----------------------------------------------------------


def _tp2_then_pp2_worker(rank: int, world_size: int, cases: list[tuple[object, dict[str, torch.Tensor]]]):
    import torch.distributed as dist

    from pipeline.models.factory import build_gpt_model
    from pipeline.parallel.context import ParallelContext
    from tests.oracles.sharding import shard_full_state_dict

    # One process group for both layouts: megatron's groups are rebuilt on top of it.
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = []
    for spec, hf_state in cases:
        input_ids, position_ids, causal_mask = _batch(spec.vocab_size)
        # TP = 2: each rank loads its own shard; the vocab-parallel logits are gathered.
        context = ParallelContext.initialize(tensor_parallel=2, pipeline_parallel=1, seed=0)
        layout = MegatronLayout.build(spec, tp_size=2)
        model = build_gpt_model(spec, parallel_context=context).eval()
        shard = dict(hf_to_megatron_state(hf_state, spec=spec, layout=layout, tp_rank=context.tp_rank))
        # Cross-check against the models helper's attribute-driven slicer.
        full = dict(hf_to_megatron_state(hf_state, spec=spec, layout=layout))
        reference = shard_full_state_dict(model, full, tp_rank=context.tp_rank, tp_size=2)
        slicer_agrees = all(torch.equal(shard[name], reference[name]) for name in shard)
        copy_into_model(model, shard.items())
        with torch.no_grad():
            local_logits = model(input_ids, position_ids, causal_mask)  # (B, T, V / 2)
        gathered = [torch.empty_like(local_logits) for _ in range(2)]
        dist.all_gather(gathered, local_logits.contiguous(), group=context.tp_group)
        tp_states = [None, None]
        dist.all_gather_object(tp_states, {k: v for k, v in model.state_dict().items() if v is not None})
        tp_logits = torch.cat(gathered, dim=-1)  # (B, T, V)
        tp_export = dict(megatron_to_hf_state([tp_states], spec=spec, layout=layout))
        context.destroy()

        # PP = 2: stage 0 sends its hidden states to stage 1 by hand.
        context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=2, seed=0)
        layout = MegatronLayout.build(spec, pp_size=2)
        model = build_gpt_model(spec, parallel_context=context).eval()
        copy_into_model(model, hf_to_megatron_state(hf_state, spec=spec, layout=layout, tp_rank=0, pp_rank=context.pp_rank))
        with torch.no_grad():
            if context.pp_rank == 0:
                hidden = model(input_ids, position_ids, causal_mask)  # (T, B, H)
                dist.send(hidden.contiguous(), dst=1)
                pp_logits = None
            else:
                hidden = torch.empty(SEQ_LEN, BATCH, spec.hidden_size)
                dist.recv(hidden, src=0)
                model.set_input_tensor(hidden)
                pp_logits = model(input_ids, position_ids, causal_mask)  # (B, T, V)
        pp_states = [None, None]
        dist.all_gather_object(pp_states, {k: v for k, v in model.state_dict().items() if v is not None})
        pp_export = dict(megatron_to_hf_state([[pp_states[0]], [pp_states[1]]], spec=spec, layout=layout))
        context.destroy()
        results.append(
            {"tp_logits": tp_logits, "pp_logits": pp_logits, "tp_export": tp_export, "pp_export": pp_export,
             "slicer_agrees": slicer_agrees}
        )
    dist.destroy_process_group()
    return results


@pytest.mark.distributed
def test_tp2_and_pp2_logits_match_hf_and_live_states_export_bit_exact():
    # The factory rejects num_query_groups < TP, so all have two groups (= TP): one
    # Qwen2 with biases, one tied Llama whose last PP stage holds the embedding copy, one
    # Qwen3 whose replicated per-head q/k norms every TP rank applies to its own heads.
    specs = [PARITY_SPECS["qwen2-gqa-theta1e6"], PARITY_SPECS["llama3.2-scaling-x32"],
             PARITY_SPECS["qwen3-tied-gqa-theta1e6"]]
    hf_models = [build_hf_model(spec) for spec in specs]
    cases = [(spec, hf_saved_state(model, spec)) for spec, model in zip(specs, hf_models)]
    results = run_distributed(_tp2_then_pp2_worker, world_size=2, args=(cases,), timeout_s=240)
    for (spec, hf_state), model, rank0, rank1 in zip(cases, hf_models, results[0], results[1]):
        expected = _hf_logits(model, _batch(spec.vocab_size)[0])
        assert (rank0["tp_logits"] - expected).abs().max().item() <= TOLERANCE
        assert torch.equal(rank0["tp_logits"], rank1["tp_logits"])
        assert (rank1["pp_logits"] - expected).abs().max().item() <= TOLERANCE
        assert rank0["slicer_agrees"] and rank1["slicer_agrees"]
        for export in (rank0["tp_export"], rank0["pp_export"]):
            assert set(export) == set(hf_state)
            assert all(torch.equal(export[name], tensor) for name, tensor in hf_state.items())


def test_qwen3_per_head_norms_reach_megatron(megatron_single_rank):
    # Control for the Qwen3 parity case: megatron with the q/k norm weights reset to one (what
    # a map that dropped them would leave) is far from HF, so the norms are applied, per head.
    spec = PARITY_SPECS["qwen3-tied-gqa-theta1e6"]
    hf_model = build_hf_model(spec)
    expected = _hf_logits(hf_model, _batch(spec.vocab_size)[0])
    state = hf_saved_state(hf_model, spec)
    model = _megatron_model(spec, {name: torch.ones_like(t) if name.endswith(("q_norm.weight", "k_norm.weight")) else t
                                   for name, t in state.items()})
    assert model.decoder.layers[0].self_attention.q_layernorm.weight.shape == (spec.kv_channels,)
    assert (_megatron_logits(model, spec) - expected).abs().max().item() > 100 * TOLERANCE
