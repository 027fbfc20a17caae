"""The built-in schemes' lines of the registry (config/registry/__init__.py reads them): each
bias type, score-term scheme and part by name with its class ("module:Class", imported when a model
is built), its forms and its switch; the presets of the schemes kept whole in their own file; and
their options (`SchemeOptions`, fields of `model.attention`, documented and checked here). A new
built-in scheme is its file in relpos_ablate/model/schemes/ and its lines here. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from relpos_ablate.config.base import ConfigError, check_choice, check_range, reject


class Builtin(NamedTuple):
    """A built-in scheme: "module:Class" (imported when a model is built), the forms it supplies
    (space-separated planner.FORMS) and, for a score term, the config field that switches it on."""

    target: str
    forms: str = ""
    #: "field" (on at any value but its off value: false, 0, 'none', null) or "field=value"
    switch: str | None = None


#: Built-in bias types (model.attention.bias).
BUILTIN_BIASES: dict[str, Builtin] = {
    "xl_table": Builtin("relpos_ablate.model.schemes.tables:XLTableBias", "band"),
    "t5": Builtin("relpos_ablate.model.schemes.tables:T5Bias", "band"),
    "alibi": Builtin("relpos_ablate.model.schemes.alibi:ALiBiBias", "key_offsets"),
    "alibi_learned": Builtin("relpos_ablate.model.schemes.alibi:LearnedALiBiBias", "key_offsets"),
    "kerple_log": Builtin("relpos_ablate.model.schemes.kerple:KerpleLogBias"),
    "kerple_power": Builtin("relpos_ablate.model.schemes.kerple:KerplePowerBias"),
    "fire": Builtin("relpos_ablate.model.schemes.fire:FIREBias", "query_position"),
    "dynamic": Builtin("relpos_ablate.model.schemes.fire:DynamicBias"),
    "sandwich": Builtin("relpos_ablate.model.schemes.sandwich:SandwichBias"),
}
#: Built-in score-term schemes (model.attention.term_schemes, or their own switch).
BUILTIN_TERMS: dict[str, Builtin] = {
    "fox": Builtin("relpos_ablate.model.schemes.fox:ForgetGate", "key_offsets hand", "forget_gate"),
    "cope": Builtin(
        "relpos_ablate.model.schemes.cope:ContextualPositions",
        "content band hand",
        "cope_positions",
    ),
    "sink_logit": Builtin(
        "relpos_ablate.model.schemes.sink_logit:SinkLogit", "sinks", "sink_logit"
    ),
    "grape_a": Builtin("relpos_ablate.model.schemes.grape:GrapeA", "content", "grape=a"),
    "grape_ap": Builtin("relpos_ablate.model.schemes.grape:GrapeAP", "", "grape=ap"),
}
#: Built-in parts (core/parts.py) that add no score term, each switched on by its field.
BUILTIN_PARTS: dict[str, Builtin] = {
    "canon": Builtin("relpos_ablate.model.schemes.canon:Canon", "", "canon_width"),
    "qk_norm": Builtin("relpos_ablate.model.schemes.qk_norm:QKNorm", "", "qk_norm"),
    "rotary": Builtin("relpos_ablate.model.schemes.rope:Rotary", "", "absolute=rope"),
    "temperature_tuning": Builtin(
        "relpos_ablate.model.schemes.temperature:TemperatureTuning", "", "temperature_tuning"
    ),
    "sink_slots": Builtin("relpos_ablate.model.schemes.sinks:Sinks", "sinks", "sinks"),
    "output_gate": Builtin("relpos_ablate.model.schemes.output_gate:OutputGate", "", "output_gate"),
    "mla": Builtin("relpos_ablate.model.schemes.mla:DecoupledRotary", "", "qk_rope_dim"),
    "pope": Builtin("relpos_ablate.model.schemes.pope:PolarPositions", "", "pope"),
}
#: The `encoding:` presets of the schemes kept whole in their own file (config/presets.py adds
#: them to its words): the model.attention fields each sets.
SCHEME_PRESETS: dict[str, dict[str, Any]] = {
    # PoPE (Gopalakrishnan et al. 2025): magnitudes softplus(q_c), phases position·θ_c only, on NoPE
    "pope": {"terms": "a", "absolute": "none", "bias": "none", "pope": True},
    # GRAPE-A (arXiv 2512.07805), query- and key-gated, on QK-RMSNorm as the authors' models
    "grape_a": {"terms": "a", "absolute": "none", "bias": "none", "grape": "a", "qk_norm": "rms"},
    # GRAPE-AP: the path-integral additive form, on QK-RMSNorm as the authors' models
    "grape_ap": {"terms": "a", "absolute": "none", "bias": "none", "grape": "ap", "qk_norm": "rms"},
    # MLA's decoupled RoPE (DeepSeek-V2): 8 rotary channels per head, the rotary key shared
    "mla_rope": {"terms": "a", "absolute": "none", "bias": "none", "qk_rope_dim": 8},
}


QK_NORMS = ("none", "rms", "l2")
QK_NORM_ORDERS = ("before_rope", "after_rope")
OUTPUT_GATES = ("none", "elementwise", "headwise")
SINK_LOGITS = ("none", "off_by_one", "learned")
GRAPES = ("none", "a", "ap")
GRAPE_GATES = ("qk", "q", "k", "none")


@dataclass(frozen=True)
class SchemeOptions:
    """The options of the schemes that keep everything else in their own file
    (model/schemes/<scheme>.py): fields of `model.attention` (AttentionConfig extends this class),
    documented and checked here."""

    rope_heads: float = 1.0
    """rope: the fraction of heads that rotate: the first round(rope_heads·H) heads get RoPE, the
    others none (NoPE heads; Qwen3-Next and Qwen3.5 rotate part of each head instead:
    rope_fraction). 1: every head."""
    qk_norm: str = "none"
    """QK-norm of each head's query and key: none | rms (RMSNorm with a learned scale per head
    channel, as OLMo-2's and Qwen3's q_norm/k_norm, eps 1e-6) | l2 (unit length times a learned
    scalar per head, Llama 4's L2 norm with a learned scale; initialised at √d_head so that the
    scale of q·k/√d starts as for an RMS-normed pair).
    docs/schemes/attention-plumbing.md#qk-norm."""
    qk_norm_order: str = "before_rope"
    """qk_norm: before_rope (OLMo-2, Qwen3) | after_rope (normalise the rotated q and k)."""
    output_gate: str = "none"
    """Gated attention (Qiu et al. 2025, arXiv 2505.06708, their G1 position): each head's output
    times σ(x·W_θ) before the output projection, x the layer's (normed) input: none | elementwise
    (one gate per head channel) | headwise (one scalar per head)."""
    sink_logit: str = "none"
    """A sink logit per head that joins every row's softmax denominator with a zero value: none |
    off_by_one (s_h = 0: softmax_1, Megatron's softmax_type off-by-one) | learned (s_h learned per
    layer and head, init 0, gpt-oss). Unlike `sinks` it has no key and no value: it only takes
    attention mass away. docs/schemes/attention-plumbing.md#sink-logit."""
    qk_rope_dim: int = 0
    """MLA's decoupled RoPE (DeepSeek-V2, arXiv 2405.04434): each head's q and k are [content part
    ‖ rotary part], the last qk_rope_dim channels rotary: q's rotated per head, k's one key W_KR·x
    shared by the heads, rotated (θ_p = rope_base^(-2p/qk_rope_dim)); the content part carries no
    position. 0: off; even, below d_head; terms 'a', absolute none.
    docs/schemes/attention-plumbing.md#mla-decoupled-rope."""
    pope: bool = False
    """PoPE (arXiv 2509.10534, polar coordinate position embeddings): channel c of q and k becomes
    a magnitude softplus(x_c) at phase position·θ_c, θ_c = rope_base^(-c/d_head) (d_head
    frequencies), so q·k = Σ_c softplus(q_c)·softplus(k_c)·cos((i - j)θ_c - δ_c); terms 'a',
    absolute none. docs/schemes/attention-plumbing.md#pope."""
    pope_phase_bias: bool = False
    """pope: a learned phase bias δ_{h,c} on the keys' phases, clamped to [-2π, 0], init 0
    (x-transformers' default); false: δ = 0."""
    grape: str = "none"
    """GRAPE (arXiv 2512.07805), additive forms: none | a (GRAPE-A: -(i - j)·ω_h·[λ_q(q_i) +
    λ_k(k_j)], gates softplus(v̂_h·q/√dh), softplus(û_h·k/√dh); ALiBi at grape_gates none) | ap
    (GRAPE-AP: Σ_{l=j+1..i} α_h·log σ(p_i·R_l p̂_l / grape_ap_dim), a path sum whose every edge
    also reads the query; FoX when the edges read the key side alone). Causal, term 'a'.
    docs/schemes/attention-plumbing.md#grape."""
    grape_gates: str = "qk"
    """grape a: which gates: qk (GRAPE-A-QK) | q | k | none (no gate: ALiBi's -(i - j)·ω_h)."""
    grape_ap_dim: int = 8
    """grape ap: width d_p of the per-head probes p = W_p·x (the authors' 8; even)."""
    canon_width: int = 0
    """Canon layer (Allen-Zhu 2025, Physics of Language Models 4.1), at point A: the attention's
    input x plus a causal depthwise convolution of it over the last canon_width tokens (memory
    tokens included). 0: off; the paper's 4."""

    def check_options(self) -> None:
        """Each option's allowed values, and what it needs of the other fields."""
        check_range("rope_heads", self.rope_heads, low=1e-9, high=1.0)
        if self.rope_heads != 1.0 and getattr(self, "absolute", None) != "rope":
            reject("rope_heads", "is a RoPE variant; set absolute='rope'")
        check_choice("qk_norm", self.qk_norm, QK_NORMS)
        check_choice("qk_norm_order", self.qk_norm_order, QK_NORM_ORDERS)
        check_choice("output_gate", self.output_gate, OUTPUT_GATES)
        check_choice("sink_logit", self.sink_logit, SINK_LOGITS)
        check_range("canon_width", self.canon_width, low=0)
        if self.canon_width and getattr(self, "chunk", None) is not None:
            reject("canon_width", "a chunk would see its neighbour's tokens; use chunk: null")
        check_range("qk_rope_dim", self.qk_rope_dim, low=0)
        for name, on in (("qk_rope_dim", self.qk_rope_dim), ("pope", self.pope)):
            if on and (
                getattr(self, "terms", "a") != "a" or getattr(self, "absolute", "") != "none"
            ):
                reject(name, "places q·k of term a itself: use terms 'a', absolute none")
        if self.pope_phase_bias and not self.pope:
            reject("pope_phase_bias", "is PoPE's; set pope: true")
        if self.pope and self.qk_rope_dim:
            reject("pope", "and qk_rope_dim both place q·k; use one")
        check_choice("grape", self.grape, GRAPES)
        check_choice("grape_gates", self.grape_gates, GRAPE_GATES)
        if self.grape != "none" and not getattr(self, "causal", True):
            reject("grape", "is causal only; set causal: true")
        if self.grape != "none" and getattr(self, "terms", "a") != "a":
            reject("grape", "adds to term a's scores: use terms 'a'")
        if self.grape_ap_dim < 2 or self.grape_ap_dim % 2:
            reject("grape_ap_dim", f"{self.grape_ap_dim}: an even width of at least 2")

    def check_option_widths(self, d_model: int, d_head: int) -> None:
        """What the options need of the layer's widths (ModelConfig and the attention check it)."""
        if self.qk_rope_dim and (self.qk_rope_dim % 2 or self.qk_rope_dim >= d_head):
            raise ConfigError(
                "qk_rope_dim", f"{self.qk_rope_dim}: an even width below d_head {d_head}"
            )
