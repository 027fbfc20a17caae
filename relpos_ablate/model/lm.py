"""TransformerLM: a Transformer-XL style language model built around RelPosAttention.

Features: token embedding (tied output by default); n layers of attention + ReLU feed-forward with
pre-LN (default) or post-LN (Transformer-XL); absolute baselines (sinusoid / learned at the input,
learned at every layer as Al-Rfou et al.); segment recurrence: layer l's input from earlier segments
is kept as memory (FIFO, `mem_len` tokens, detached: no gradient ever flows into it) and prepended
to its keys and values. Evaluation may use another mem_len and clamp_len than training, and
`same_length`. Positions are 0 .. L - 1 unless given (`positions=`) or randomized (Ruoss et al.
2023, `attention.positions: randomized`: each forward draws them). Evaluation can collect attention
statistics in the same pass (`statistics=`, diagnostics.py). `inspect` returns every layer's
attention probabilities and separate score-term maps.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_ablate.config.attention import AttentionConfig
from relpos_ablate.config.base import ConfigError
from relpos_ablate.config.model import ModelConfig
from relpos_ablate.config.schedule import bias_key
from relpos_ablate.model.attention import RelPosAttention, init_vector
from relpos_ablate.model.core.options import AttentionOptions, SharedParameters
from relpos_ablate.model.diagnostics import AttentionStatistics
from relpos_ablate.model.documents import checked, document_positions
from relpos_ablate.model.schemes import RopeScaling, bias_schemes, build_bias, sinusoid
from relpos_ablate.model.schemes.absolute import (
    LearnedPositions,
    randomized_distances,
    randomized_positions,
)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over marked positions, without a host sync (an all-False mask gives 0)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


class Layer(nn.Module):
    """One transformer layer: attention over [memory; input] then feed-forward, each with a
    residual."""

    def __init__(
        self, cfg: ModelConfig, shared: SharedParameters, attention: AttentionConfig | None = None
    ):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        a = attention or cfg.attention  # this layer's (ModelConfig.layer_attention)
        self.attn = RelPosAttention(
            cfg.d_model, cfg.n_heads, cfg.d_head, a, dropout=cfg.attn_dropout, shared=shared
        )
        self.norm_attn = nn.LayerNorm(cfg.d_model)
        self.norm_ff = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_inner),
            nn.ReLU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.d_inner, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.positions = (
            LearnedPositions(a.max_position, cfg.d_model)
            if a.absolute == "learned_per_layer"
            else None
        )

    def layer_input(self, h: Tensor, positions: Tensor | None = None) -> Tensor:
        """What this layer reads (and keeps as memory): h, plus its own positions for Al-Rfou (at
        `positions` [L] when given)."""
        return h if self.positions is None else h + self.positions(h.shape[1], positions)

    def forward(
        self,
        h: Tensor,
        mem: Tensor | None,
        options: AttentionOptions,
        *,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if self.pre_norm:
            attn_out, probs = self.attn(
                *self.attention_inputs(h, mem), options, need_weights=need_weights
            )
            h = h + self.drop(attn_out)
            return h + self.drop(self.ff(self.norm_ff(h))), probs
        attn_out, probs = self.attn(h, mem, options, need_weights=need_weights)
        h = self.norm_attn(h + self.drop(attn_out))
        return self.norm_ff(h + self.drop(self.ff(h))), probs

    def attention_inputs(self, h: Tensor, mem: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The (x, mems) this layer's attention sees."""
        if self.pre_norm:
            return self.norm_attn(h), None if mem is None else self.norm_attn(mem)
        return h, mem


class TransformerLM(nn.Module):
    """Language model with segment memory: `logits, new_mems = model(tokens, mems)`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size < 1:
            raise ConfigError("vocab_size", "must be >= 1 (run configs take it from the data)")
        self.config = config
        a = config.attention
        # every layer's attention (layer_pattern, else the model's)
        self.layer_configs = config.layer_attentions
        # registered here once (one state_dict entry each); every layer's attention refers to them
        uv = [layer for layer in self.layer_configs if layer.share_uv]
        self.content_bias_u = (
            init_vector(config.n_heads, config.d_head) if any("c" in x.terms for x in uv) else None
        )
        self.position_bias_v = (
            init_vector(config.n_heads, config.d_head) if any("d" in x.terms for x in uv) else None
        )
        shared = self._shared_bias_schemes()
        schemes = list(shared.values())
        self.shared_bias_scheme = schemes[0] if schemes else None
        # layer kinds' own biases
        self.other_bias_schemes = nn.ModuleList(schemes[1:]) if len(schemes) > 1 else None
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.input_positions = (
            LearnedPositions(a.max_position, config.d_model) if a.absolute == "learned" else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            Layer(
                config,
                SharedParameters(
                    self.content_bias_u,
                    self.position_bias_v,
                    shared.get(bias_key(layer, a)) if layer.share_bias else None,
                ),
                layer,
            )
            for layer in self.layer_configs
        )
        self.final_norm = nn.LayerNorm(config.d_model) if config.norm == "pre" else nn.Identity()
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_weights:
            self.head.weight = self.embed.weight

    def _shared_bias_schemes(self) -> dict:
        """share_bias: one bias module per distinct bias setting among the layers (layers whose
        attention differs in a layer kind's own fields only, e.g. their window, share one), by
        `bias_key`, in the layers' order (the model's attention's first); a layer without a bias or
        with share_bias off is in none."""
        schemes = {}
        for layer in self.layer_configs:
            key = bias_key(layer, self.config.attention)
            if layer.share_bias and layer.bias != "none" and key not in schemes:
                schemes[key] = build_bias(layer, self.config.n_heads, self.config.d_head)
        return schemes

    def _init_weights(self) -> None:
        """Linear and Embedding weights N(0, 0.02), Linear biases 0 (GPT-2; Transformer-XL's
        init_std), except inside bias schemes, which keep their own published init: FIRE's and the
        dynamic MLP's PyTorch default Linear init (zero biases would put every first-layer kink at
        distance 0, leaving the MLP linear in its input for all causal distances)."""
        own_init = {id(m) for scheme in bias_schemes(self) for m in scheme.modules()}
        for module in self.modules():
            if id(module) in own_init:
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def attention_layers(self) -> list[RelPosAttention]:
        return [layer.attn for layer in self.layers]

    def layer_names(self) -> list[str]:
        """`layer k` per layer, with its pattern word where the config has a layer_pattern (`layer 3
        global`)."""
        words = [self.config.layer_word(k) for k in range(len(self.layers))]
        return [f"layer {k}" + (f" {word}" if word else "") for k, word in enumerate(words)]

    def _embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        # (B, L, D); see ModelConfig.embed_scale
        h = self.embed(tokens) * self.config.embedding_multiplier
        length = tokens.shape[1]
        if self.config.attention.absolute == "sinusoid":
            # Vaswani et al.: positions 0..L-1 of the segment (memory keeps its own; XL's point)
            at = torch.arange(length, device=tokens.device) if positions is None else positions
            h = h + sinusoid(at, self.config.d_model).to(h.dtype)
        elif self.input_positions is not None:
            h = h + self.input_positions(length, positions)
        return self.drop(h)

    def _options(
        self,
        tokens: Tensor,
        mems: list[Tensor] | None,
        mem_len: int | None,
        clamp_len: int | None,
        same_length: bool,
        positions: Tensor | None,
        rope_scaling: RopeScaling | None = None,
        document_ids: Tensor | None = None,
    ) -> tuple[int, Tensor | None, list[AttentionOptions]]:
        """This call's memory length M (the argument, else the config's), the positions of its
        tokens as the input's absolute encodings read them (None: 0 .. L - 1 of the segment; over
        packed documents [B, L], each token's place in its document) and each layer's options."""
        mem_len = self.config.mem_len if mem_len is None else mem_len
        if same_length and mem_len == 0:
            raise ValueError(
                "same_length: every query sees the last mem_len keys, and mem_len is 0; set "
                "mem_len > 0"
            )
        # Transformer-XL's same_length: each query sees its mem_len most recent keys, itself
        # included
        options = AttentionOptions(
            clamp_len=clamp_len,
            window=mem_len if same_length else None,
            positions=positions,
            rope_scaling=rope_scaling,
        )
        if document_ids is not None:
            options = dataclasses.replace(
                options, document_ids=self._documents(document_ids, tokens, mems)
            )
        per_layer = [options] * len(self.layers)
        if rope_scaling is not None and any(a.absolute == "rope" for a in self.layer_configs):
            # a context extension rescales the RoPE layers' frequencies; the others of a layer
            # pattern have none
            per_layer = [
                options if a.absolute == "rope" else dataclasses.replace(options, rope_scaling=None)
                for a in self.layer_configs
            ]
        if positions is not None:
            return mem_len, positions[-tokens.shape[1] :], per_layer
        if document_ids is not None:  # (randomized positions are refused by the layers)
            at = document_positions(options.document_ids)[:, -tokens.shape[1] :]
            return mem_len, at, per_layer
        at_input, draws = self._draws(
            tokens.shape[1], 0 if not mems else mems[0].shape[1], tokens.device
        )
        return (
            mem_len,
            at_input,
            [dataclasses.replace(o, **draw) for o, draw in zip(per_layer, draws)],
        )

    @staticmethod
    def _documents(ids: Tensor, tokens: Tensor, mems: list[Tensor] | None) -> Tensor:
        """The call's document ids [B, M + L], checked: [B, L] without memory, [B, M + L] with."""
        return checked(ids, tokens.shape[0], tokens.shape[1], mems[0].shape[1] if mems else 0)

    def _draws(
        self, n_tokens: int, n_mem: int, device
    ) -> tuple[Tensor | None, list[dict[str, Tensor | None]]]:
        """Randomized positions when the config asks for them in this mode (training, or evaluation:
        `eval_positions`), else none (0 .. M + L - 1): (the input's, each layer's positions and
        distances). randomized_draw per_layer (Ruoss et al.'s code, models/transformer.py): one draw
        of positions for the absolute encodings at the input, then every layer its own RoPE
        positions and relative distances; shared_positions: one draw of positions for every encoding
        of every layer."""
        a = self.config.attention
        mode = a.positions if self.training else (a.eval_positions or a.positions)
        if mode == "sequential":
            return None, [{}] * len(self.layers)
        if n_mem:
            raise ValueError(
                "model.attention.positions: randomized positions are drawn per segment, and memory "
                "keys would keep another draw's; use mem_len 0"
            )
        if a.randomized_draw == "shared_positions":
            shared = randomized_positions(n_tokens, a.max_position, device)
            return shared, [{"positions": shared}] * len(self.layers)
        absolute = any(
            x.absolute in ("sinusoid", "learned", "learned_per_layer") for x in self.layer_configs
        )
        at_input = randomized_positions(n_tokens, a.max_position, device) if absolute else None
        return at_input, [
            # what reads per-distance tensors
            {
                "positions": randomized_positions(n_tokens, a.max_position, device)
                if x.absolute == "rope"
                else None,
                "distances": randomized_distances(n_tokens, a.max_position, device)
                if x.bias != "none" or x.uses_r or x.shaw_values
                else None,
            }
            for x in self.layer_configs
        ]

    def _run(
        self,
        tokens: Tensor,
        mems: list[Tensor] | None,
        mem_len: int,
        token_positions: Tensor | None,
        layer_options: list[AttentionOptions],
        *,
        record_maps: bool = False,
        statistics: AttentionStatistics | None = None,
    ):
        if mems is not None and len(mems) != len(self.layers):
            raise ValueError(
                f"mems: expected {len(self.layers)} tensors (one per layer), got {len(mems)}"
            )
        h = self._embed(tokens, token_positions)
        new_mems, probs, terms = [], [], []
        for i, (layer, options) in enumerate(zip(self.layers, layer_options)):
            mem = None if mems is None else mems[i].detach()
            h = layer.layer_input(h, token_positions)
            if mem_len > 0:
                kept = h if mem is None else torch.cat([mem, h], dim=1)  # (B, M + L, D)
                new_mems.append(kept[:, -mem_len:].detach())
            if record_maps:  # every layer's term maps and probabilities, for inspect
                terms.append(layer.attn.score_terms(*layer.attention_inputs(h, mem), options))
            if statistics is not None:
                options = dataclasses.replace(options, statistics=statistics.layer(i))
            h, p = layer(h, mem, options, need_weights=record_maps)
            probs.append(p)
        logits = self.head(self.final_norm(h))
        return logits, (new_mems if mem_len > 0 else None), probs, terms

    def forward(
        self,
        tokens: Tensor,
        mems: list[Tensor] | None = None,
        *,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool = False,
        positions: Tensor | None = None,
        statistics: AttentionStatistics | None = None,
        rope_scaling: RopeScaling | None = None,
        document_ids: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor] | None]:
        """tokens [B, L] -> (logits [B, L, V], new_mems: per layer [B, <= mem_len, D] detached, or
        None).

        mem_len / clamp_len override the config for this call (e.g. evaluation with longer memory);
        same_length: every query sees its mem_len most recent keys (Transformer-XL's evaluation);
        positions [M + L]: the positions of the memory tokens, then of this segment's, shared by the
        batch (default: drawn when the config randomizes them, else 0 .. M + L - 1); statistics: add
        every layer's attention statistics there (diagnostics.py); rope_scaling: RoPE extended to a
        longer context (an evaluation setting's PI / NTK / YaRN); document_ids [B, L] (or [B, M + L]
        with memory, its ids first; int, equal ids = one document): packed documents, each token
        attending to its own document, its absolute position counted from the document's first
        token (model/documents.py).
        """
        mem_len, at_input, options = self._options(
            tokens, mems, mem_len, clamp_len, same_length, positions, rope_scaling, document_ids
        )
        logits, new_mems, _, _ = self._run(
            tokens, mems, mem_len, at_input, options, statistics=statistics
        )
        return logits, new_mems

    @torch.no_grad()
    def inspect(
        self,
        tokens: Tensor,
        mems: list[Tensor] | None = None,
        *,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool = False,
        positions: Tensor | None = None,
        rope_scaling: RopeScaling | None = None,
        document_ids: Tensor | None = None,
    ) -> dict:
        """Everything the plots need: logits, new mems, per-layer probabilities [B, H, L, M+L] and
        per-layer score-term maps {'a', 'b', 'c', 'd', 'bias', each score term's name, 'visible'}
        (enabled ones only)."""
        mem_len, at_input, options = self._options(
            tokens, mems, mem_len, clamp_len, same_length, positions, rope_scaling, document_ids
        )
        logits, new_mems, probs, terms = self._run(
            tokens, mems, mem_len, at_input, options, record_maps=True
        )
        return {"logits": logits, "mems": new_mems, "probs": probs, "terms": terms}

    def loss(self, logits: Tensor, targets: Tensor, mask: Tensor | None = None) -> Tensor:
        """Mean cross-entropy over positions where mask is True (all when None)."""
        # (B·L, V) -> (B·L)
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return losses.mean() if mask is None else masked_mean(losses, mask.flatten())
