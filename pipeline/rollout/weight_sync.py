"""Weights from the Megatron actor to a rollout engine, through the one HF⇄Megatron map.

The local engine runs a Hugging Face model; every sync converts the actor's
(possibly TP/PP-sharded) weights with ``pipeline.checkpoint.convert`` — the same
code path as ``winnow convert megatron-to-hf`` — so each RL step also exercises the
conversion. Shards are gathered to global rank 0 (which drives the engine); other
data-parallel replicas hold copies and send nothing.

The names are those of the actor's layer spec (``actor.layer_spec_choice``): a
Transformer Engine actor fuses its norms into the next linear layer
(``…linear_qkv.layer_norm_weight``, ``…linear_fc1.layer_norm_weight``), a local one
keeps them apart (``…input_layernorm.weight``). Tensors leave the GPU here: the map
and every engine take CPU tensors.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from pipeline.checkpoint.convert import megatron_to_hf_state
from pipeline.checkpoint.hf_map import MegatronLayout
from pipeline.models.spec import ModelSpec
from pipeline.parallel.rendezvous import gather_to_rank0


def build_hf_model(spec: ModelSpec, *, dtype: torch.dtype = torch.float32):
    """An HF causal LM with ``spec``'s architecture (random weights until the first sync)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = dict(spec.to_hf_config())
    model_type = hf_config.pop("model_type")
    hf_config.pop("architectures")
    config = AutoConfig.for_model(model_type, **hf_config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def actor_hf_state(actor) -> Iterator[tuple[str, torch.Tensor]] | None:
    """HF-named tensors of the actor's current weights on global rank 0; ``None`` elsewhere.

    Every rank must call it (it gathers over the world group when there is more than one).
    """
    context = actor.context
    local = {k: v.detach().cpu() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
    layout = MegatronLayout.build(
        actor.spec, layer_spec=actor.layer_spec_choice.name, tp_size=context.tensor_parallel,
        pp_size=context.pipeline_parallel,
    )
    if context.world_size == 1:
        return megatron_to_hf_state([[local]], spec=actor.spec, layout=layout)
    payload = (context.pp_rank, context.tp_rank, local if context.dp_rank == 0 else None)
    gathered = gather_to_rank0(payload, rank=context.rank, world_size=context.world_size)
    if gathered is None:
        return None
    grid: list[list] = [[None] * context.tensor_parallel for _ in range(context.pipeline_parallel)]
    for pp_rank, tp_rank, state in gathered:
        if state is not None:
            grid[pp_rank][tp_rank] = state
    return megatron_to_hf_state(grid, spec=actor.spec, layout=layout)


def sync_actor_to_engine(actor, engine, *, version: int) -> None:
    """Push the actor's weights into a local engine as weight ``version`` (collective)."""
    pairs = actor_hf_state(actor)
    if pairs is not None:
        engine.update_weights(pairs, version=version)


class DiskSyncedEngine:
    """An SGLang engine whose weights follow the actor through a shared folder.

    Each sync writes the HF export to ``<weights_dir>/v<version>`` (atomically: the
    writer stages and renames) and asks every server to load it; the previous export
    is removed once the servers run the new one. Generation passes through. This is
    the path that works when trainer and servers are on different nodes with only a
    shared filesystem between them.
    """

    def __init__(self, engine, *, weights_dir: str | Path, spec: ModelSpec, tokenizer_dir: str | Path) -> None:
        self.engine = engine
        self.weights_dir = Path(weights_dir)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.tokenizer_dir = Path(tokenizer_dir)
        self._current: Path | None = None

    def generate(self, requests, params):
        return self.engine.generate(requests, params)

    def update_weights(self, named_tensors, *, version: int) -> None:
        from pipeline.checkpoint.hf_io import write_hf_checkpoint

        export = write_hf_checkpoint(self.weights_dir / f"v{version}", named_tensors, spec=self.spec,
                                     tokenizer_dir=self.tokenizer_dir, overwrite=True)
        self.engine.update_weights_from_disk(str(export), version=version)
        if self._current is not None and self._current != export:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = export

    def close(self) -> None:
        self.engine.close()
