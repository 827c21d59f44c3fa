"""What switchyard adds to vLLM's worker (`worker_extension_cls`): methods the engine calls by name
through `collective_rpc`, run in the worker process next to the model.

Tied word embeddings (`retie_word_embeddings`). vLLM 0.32's in-place reload (`reload_weights`)
rebuilds each layer from the tensors sent for it and re-runs that layer's post-load processing.
A tied output head has no tensor of its own (the checkpoint and the trainer send only
`model.embed_tokens.weight`), so its layer is never reprocessed: its parameter is the embedding's
and holds the new values, but whatever kernel copy the processing made of it stays as loaded at
start. On CPU that is the oneDNN-packed matrix every logit is computed with: the engine sampled
from the first version's output head forever, 1e-2 logprob drift after one step of full training.
After each reload the head of every embedding it shares its storage with is processed again.

Digests (`weight_digest`, engines/weight_digest.py): each tensor the engine serves, under its HF
name, taken with the engine's own kernels where a layer has one (a linear layer's output for the
probe vector, split back into the HF tensors a fused layer holds), so a stale kernel copy shows.
"""

from __future__ import annotations

from typing import Any


def _tied_heads(model: Any) -> list[Any]:
    """The output heads whose weight is an input embedding's (shared storage)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeds = {m.weight.untyped_storage().data_ptr() for m in model.modules()
              if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    return [m for m in model.modules() if isinstance(m, ParallelLMHead)
            and m.weight.untyped_storage().data_ptr() in embeds]


def _hf_names(module_name: str, param: str, packed: dict[str, list[str]]) -> list[str]:
    """The HF tensor names a vLLM parameter holds, in its row order (a fused layer: several)."""
    parent, _, leaf = module_name.replace(".base_layer", "").rpartition(".")  # a LoRA wrapper's base layer
    prefix = f"{parent}." if parent else ""
    return [f"{prefix}{part}.{param}" for part in packed.get(leaf, [leaf])]


class WorkerTools:
    """Mixed into vLLM's worker class by `worker_extension_cls` (see the module docstring)."""

    def _switchyard_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def retie_word_embeddings(self) -> int:
        """Process each tied output head again after a reload; returns how many there were."""
        import torch

        heads = _tied_heads(self._switchyard_model())
        with torch.no_grad():
            for head in heads:
                head.quant_method.process_weights_after_loading(head)
        return len(heads)

    def weight_digest(self, only: list[str] | None = None) -> dict[str, tuple[float, float]] | None:
        """{HF name: digest} of what this worker serves (of the HF names `only`, when given: a layer none of
        whose tensors is asked for is not run); None with tensor parallelism (each worker holds a
        shard, which this does not reassemble)."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        from engines.weight_digest import of_output, probe, probe_output

        if get_tensor_model_parallel_world_size() != 1:
            return None
        model = self._switchyard_model()
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        wanted = None if only is None else set(only)
        out: dict[str, tuple[float, float]] = {}
        with torch.no_grad():
            for mname, module in model.named_modules():
                params = dict(module.named_parameters(recurse=False))
                if wanted is not None:
                    params = {p: v for p, v in params.items() if wanted.intersection(_hf_names(mname, p, packed))}
                weight = params.get("weight")
                sizes: list[int] = []
                if isinstance(module, (LinearBase, ParallelLMHead)) and weight is not None:
                    # the layer's own kernel on the probe: a packed or fused copy is what is digested (on
                    # CPU a linear layer's `weight` is emptied once its packed copy is made)
                    k = getattr(module, "input_size_per_partition", None) or module.embedding_dim
                    x = probe(int(k), weight.device).to(getattr(module, "params_dtype", weight.dtype))
                    rows = module.quant_method.apply(module, x[None])[0]
                    sizes = list(getattr(module, "output_partition_sizes", None) or [rows.numel()])
                    params["weight"] = rows
                elif isinstance(module, VocabParallelEmbedding) and weight is not None:
                    params["weight"] = probe_output(weight)
                if isinstance(module, VocabParallelEmbedding) and "weight" in params:
                    params["weight"] = params["weight"][: module.org_vocab_size]  # no padding rows
                    sizes = [module.org_vocab_size]
                for pname, value in params.items():
                    names = _hf_names(mname, pname, packed)
                    v = probe_output(value)  # a 2-D tensor taken raw (an embedding): its rows for the probe
                    split = sizes if len(sizes) == len(names) and sum(sizes) == v.numel() else [v.numel()]
                    if len(split) == len(names):  # a fused tensor splits into the HF tensors it holds
                        for name, part in zip(names, torch.split(v.flatten(), split)):
                            out[name] = of_output(part)
        return out if wanted is None else {n: d for n, d in out.items() if n in wanted}
