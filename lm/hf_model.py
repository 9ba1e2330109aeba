"""Hugging Face `transformers` wrappers around DecoderLM (the exported model's code; lm/export_hf.py).

`SparseHeadsConfig` carries this package's model config (`lm_model`, the `model` section of a run
config) and `SparseHeadsForCausalLM` builds the very same `lm.model.DecoderLM` from it: the head code is
imported from this package, never copied, so an exported directory needs `sparse-heads-lm` installed
(`trust_remote_code=True` loads the two-line module the export writes, which imports these classes).

Generation through `model.generate` recomputes the whole prefix at every step (no `past_key_values`):
correct for every head type, causal or not; this package's own KV-cached decoding is lm/generate.py.
Inputs must be unpadded (attention_mask all ones): the heads have no padding mask.

A model with a non-causal head (MoSA expert choice, balanced Routing clusters, MoSAIC random priority) gives, in
eval mode, leak-free logits: position t's from tokens[:, :t+1] alone (lm/leakfree.py, about T/2 forward passes),
so a `labels` loss or lm-eval's `hf` backend scores it honestly, as lm/evaluate.py and lm/lm_eval.py do; in
training mode the published, teacher-forced forward. `generate` uses only the last position, which needs one pass.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lm.config_io import from_dict
from lm.leakfree import leak_free_logits
from lm.model import build_model

MODEL_TYPE = "sparse_heads_lm"


class SparseHeadsConfig(PretrainedConfig):
    """`lm_model`: the `model` section of this package's run config (lm/config.py ModelConfig, plain values)."""

    model_type = MODEL_TYPE

    def __init__(self, lm_model: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.lm_model = lm_model or {}
        kwargs.setdefault("vocab_size", self.lm_model.get("vocab_size"))
        kwargs.setdefault("max_position_embeddings", self.lm_model.get("seq_len"))
        kwargs.setdefault("hidden_size", self.lm_model.get("d_model"))
        kwargs.setdefault("num_hidden_layers", self.lm_model.get("n_layers"))
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class SparseHeadsForCausalLM(PreTrainedModel, GenerationMixin):
    """input_ids[B, T] -> logits[B, T, V] of the wrapped DecoderLM (`self.lm`)."""

    config_class = SparseHeadsConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"

    def __init__(self, config: SparseHeadsConfig) -> None:
        super().__init__(config)
        self.lm = build_model(from_dict({"model": config.lm_model}).model)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the checkpoint; DecoderLM initialises itself when built."""

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "SparseHeadsForCausalLM":
        """transformers' loader, then the non-persistent buffers (e.g. RoPE frequencies), which it leaves
        uninitialised, recomputed by building the model once more."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, info) with output_loading_info=True
        fresh = dict(build_model(model.lm.cfg).named_buffers())
        with torch.no_grad():
            for name, buf in model.lm.named_buffers():
                module_name, _, leaf = name.rpartition(".")
                if leaf in model.lm.get_submodule(module_name)._non_persistent_buffers_set:
                    buf.copy_(fresh[name])
        return loaded

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.lm.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm.lm_head

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, last_only: bool = False,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """`last_only`: only logits[:, -1] will be read (generation), so a non-causal model needs no leak-free pass."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(f"{MODEL_TYPE}: padded inputs are not supported (attention_mask must be all ones)")
        teacher_forced = self.training or last_only or self.lm.causal
        logits = self.lm(input_ids) if teacher_forced else leak_free_logits(self.lm, input_ids)
        loss = None
        if labels is not None:  # transformers convention: labels = input_ids, shifted here; -100 ignored
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs: Any) -> dict[str, Any]:
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask"), "last_only": True}
