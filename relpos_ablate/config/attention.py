"""The attention's config: every scheme of RelPosAttention as a field. Field docstrings are the
documentation (shown by `--help`)."""

from __future__ import annotations

from dataclasses import dataclass

from relpos_ablate.config.base import ConfigError, check_choice, check_range
from relpos_ablate.config.registry import (
    BUILTIN_BIASES,
    BUILTIN_TERMS,
    SchemeOptions,
    bias_types,
    check_bias,
    check_term,
    switched_terms,
)
from relpos_ablate.config.scheme_checks import (
    check_materialised_schemes,
    check_newer_schemes,
    reads_query_position,
)

#: The built-in values of `bias`, from the registry (config/registry/builtins.py);
#: `bias_types()` adds the schemes registered at run time with register_bias.
BIAS_TYPES = ("none", *BUILTIN_BIASES)
ABSOLUTE_TYPES = ("none", "sinusoid", "learned", "learned_per_layer", "rope")
REL_SOURCES = ("sinusoid", "learned")
SCORE_SCALES = ("sqrt_d", "none", "log_n", "ssmax")
LENGTH_AWARE_SCALES = ("log_n", "ssmax")  # the scales that read log_n_length
BACKENDS = ("auto", "blocks", "sdpa", "flex", "explicit", "low_rank", "band")
POSITIONS = ("sequential", "randomized")
RANDOMIZED_DRAWS = ("per_layer", "shared_positions")
NORMS = ("pre", "post")
EMBED_SCALES = ("auto", "sqrt_d_model", "none")
#: Absolute baselines whose published code multiplies the token embedding by sqrt(d_model) ('auto').
SCALED_EMBEDDING_BY_DEFAULT = ("sinusoid", "learned_per_layer")


@dataclass(frozen=True)
class AttentionConfig(SchemeOptions):
    """One attention layer: which Transformer-XL score terms, which bias, which baseline (and the
    options of the schemes kept whole in their own file: SchemeOptions in
    config/registry/builtins.py)."""

    terms: str = "abcd"
    """Transformer-XL score terms, a subset of 'abcd' in that order: (a) q·k content, (b) q·W_R
    R_{i-j} content-position, (c) u·k global content bias, (d) v·W_R R_{i-j} global position
    bias."""
    rel: str = "sinusoid"
    """Source of R_{i-j} for terms b/d: 'sinusoid' (fixed, Transformer-XL) or 'learned' (a table of
    2·clamp_len+1 rows, Shaw et al.)."""
    clamp_len: int | None = None
    """Distances beyond clamp_len share R_{clamp_len} (null: no clamp). Required for
    rel='learned'."""
    share_uv: bool = True
    """u and v shared by all layers (XL PyTorch) or one pair per layer (false; XL TF `untie_r`)."""
    bias: str = "none"
    """Additive per-head bias B_h(i, j) (formulas: docs/schemes/distance-biases.md#bias-types); your
    own scheme: @register_bias in a module listed under `imports:`."""
    num_buckets: int = 32
    """t5: number of buckets (split in two halves when bidirectional)."""
    max_distance: int = 128
    """t5: distance where the log buckets end; xl_table: largest distance with its own row."""
    share_bias: bool = True
    """One bias module for all layers (HF T5 computes it once in layer 0) or one per layer
    (false)."""
    absolute: str = "none"
    """Absolute positions: none (NoPE) | sinusoid (added to the input, Vaswani) | learned (added to
    the input) | learned_per_layer (added at every layer, Al-Rfou) | rope (rotate q and k of term
    a)."""
    max_position: int = 2048
    """learned / learned_per_layer: size of the position table; longer segments are an error.
    Randomized positions are drawn from [0, max_position) (it must exceed the longest evaluated
    segment)."""
    positions: str = "sequential"
    """Positions every encoding reads in training: sequential (0 .. L - 1) | randomized (Ruoss et
    al. 2023: every forward draws them from [0, max_position), so training meets the positions and
    distances of longer tests; how: randomized_draw; needs mem_len 0). Attention masks stay by token
    order."""
    eval_positions: str | None = None
    """Positions at evaluation: sequential | randomized (a fresh draw per batch, as Ruoss et al.'s
    code evaluates) | null: as in training."""
    randomized_draw: str = "per_layer"
    """randomized: per_layer (Ruoss et al.'s code, models/transformer.py: the absolute tables and
    sinusoid read one draw of L sorted distinct positions from [0, max_position); every attention
    layer draws its own: RoPE L sorted positions for q and k, the relative encodings (every bias,
    terms b/d, Shaw's tables) the distance d_r each offset r = i - j reads, d_0 = 0 and d_1 < ... <
    d_(K-1) distinct from [1, max_position), mirrored for r < 0;
    docs/schemes/conventions.md#explicit-and-randomized-positions) | shared_positions (one draw of
    positions for the whole forward, every layer and encoding reads it, the relative ones at p_i -
    p_j). Draws are shared by the batch."""
    rope_base: float = 10000.0
    """rope: base of the inverse frequencies."""
    rope_fraction: float = 1.0
    """rope: fraction of each head's dimensions that rotate (partial rotary, GPT-NeoX `rotary_pct`):
    the first int(fraction·d_head) dimensions (an even number), with frequencies over that width;
    the others carry no position."""
    rope_p: float = 1.0
    """rope: p-RoPE (Barbero et al. 2025, "Round and Round We Go!"): the fraction p of the rotary
    pairs that rotate. The first int(p·d_rot/2) pairs, those of the highest frequencies, keep RoPE's
    θ_i = base^(-2i/d_rot); the other (lowest-frequency) pairs get frequency 0 and are not rotated.
    Unlike rope_fraction (GPT-NeoX's partial rotary, which spreads the whole frequency schedule over
    fewer dimensions) the schedule is cut, not squeezed (docs/schemes/baselines.md#p-rope). 1: plain
    RoPE; the `p_rope` preset: 0.75."""
    xpos_scale_base: float | None = None
    """rope: xPos (Sun et al. 2022) with this scale base B (the paper's 512): rotary pair p of a
    query at position n is scaled by ζ_p^(n/B), of a key at m by ζ_p^(-m/B), so its part of the
    score decays as ζ_p^((n-m)/B), ζ_p = (2p/d_rot + 0.4)/1.4 (docs/schemes/baselines.md#xpos);
    causal only. null: plain RoPE."""
    forget_gate: bool = False
    """FoX (Lin et al. 2025, Forgetting Transformer): a forget gate f_t = σ(w·x_t + b) per head and
    token adds Σ_{l=j+1..i} log f_l to the score of query i for key j, a data-dependent decay
    (docs/schemes/data-dependent.md#fox); causal only. The `fox` preset is this on NoPE."""
    cope_positions: int = 0
    """CoPE (Golovneva et al. 2024): number of contextual positions p_max (0: off). Query i counts
    the keys j..i it sees with gates σ(content score), p_ij = Σ of the gates, and adds s·q_i·e[p_ij]
    (interpolated, p clamped to p_max - 1) to its score (docs/schemes/data-dependent.md#cope);
    causal, needs term a."""
    term_schemes: tuple[str, ...] = ()
    """Score-term schemes added to the scores, by registered name (docs/extending/content-term.md:
    a scheme of your own is one file with `@register_term`, its module under `imports:`). The
    built-ins have their own switches (forget_gate, cope_positions)."""
    window: int | None = None
    """Causal only: a sliding window, in training and at evaluation: query i' sees key j iff 0 <=
    i' - j < window (itself and window - 1 earlier keys, memory keys included). null: no window."""
    chunk: int | None = None
    """Causal only: chunked attention (Llama 4's attention_chunk_size): the segment is cut into
    chunks of this many tokens from its first token, and a query sees only the keys of its own chunk
    up to itself (memory keys lie in earlier chunks: none). With a window, both hold. null: no
    chunks."""
    temperature_tuning: bool = False
    """Llama 4's attention temperature tuning (Hugging Face modeling_llama4.py, on its NoPE layers):
    the query at position p is multiplied by 1 + temperature_scale·log(floor((p +
    1)/temperature_floor_scale) + 1) after RoPE (terms a and b read it); p as the encodings read it
    (M + i with memory). docs/schemes/windows-sinks-temperature.md#temperature-tuning."""
    temperature_floor_scale: float = 8192.0
    """temperature_tuning: Llama 4's floor_scale (8192)."""
    temperature_scale: float = 0.1
    """temperature_tuning: Llama 4's attn_scale (0.1)."""
    sinks: int = 0
    """Learned sink slots per layer: this many key/value pairs per head that every query sees
    besides its keys, whatever the window; they carry no position
    (docs/schemes/windows-sinks-temperature.md#sinks); memory does not count them."""
    shaw_values: bool = False
    """Shaw et al. value embeddings: add Σ_j p_ij a^V_{clip(i-j)} to the output (needs
    rel='learned')."""
    normaliser: str = "softmax"
    """What turns a query's scores into weights: softmax | stick_breaking (Tan et al. 2025: key j
    takes a share σ(z_ij) of what the nearer keys left, the rest goes to the query's own key;
    docs/schemes/score-readers.md#stick-breaking; causal, no sinks). stick_breaking needs the scores
    themselves: backend auto, sdpa (per query block) or explicit."""
    path: bool = False
    """PaTH (Yang et al. 2025): term a's q_i·k_j becomes q_iᵀ H_i'···H_(j+1) k_j, through
    data-dependent transforms H_t = I - β_t·w_t·w_tᵀ of the tokens between
    (docs/schemes/score-readers.md#path); terms 'a', no RoPE, causal. Needs the scores themselves:
    backend auto, sdpa (per query block) or explicit."""
    dape: str = "none"
    """DAPE (Zheng et al. 2024): the bias B adjusted by a network of the other scores X and B, X +
    B + f([X; B]): v1 a per-pair MLP over the heads, v2 two 1×dape_kernel convolutions along the
    keys (docs/schemes/score-readers.md#dape); needs a bias. Needs the scores themselves: backend
    auto, sdpa (per query block) or explicit. none: off."""
    dape_width: int = 32
    """dape: hidden width of f (the authors' mlp_width, 32)."""
    dape_kernel: int = 3
    """dape v2: width of the convolutions along the keys (odd; the authors' 3)."""
    score_scale: str = "sqrt_d"
    """Scale of terms a-d: 'sqrt_d' multiplies their sum by 1/sqrt(d_head) (XL); 'none' leaves them
    unscaled (T5); 'log_n' is sqrt_d with the whole score of a query that sees n keys multiplied by
    log(n)/log(log_n_length) (scalable softmax with a fixed s;
    docs/schemes/windows-sinks-temperature.md#length-aware-scaling); 'ssmax' is sqrt_d with it
    multiplied by s_h·log(n), s_h learned per head and layer (Nakanishi 2025's SSMax), initialised
    at 1/log(log_n_length) so that a query seeing L_train keys starts at a multiplier of 1."""
    log_n_length: int = 0
    """score_scale log_n / ssmax: the length L_train with log_{L_train}(n) = 1 (0: the run's
    training attention length, train.segment_len + model.mem_len, filled in when the run starts)."""
    learned_temperature: bool = False
    """Multiply the whole score of head h by a learned τ_h = exp(t_h), t_h initialised at 0 (τ =
    1)."""
    bias_scaled: bool = False
    """Whether the additive bias is scaled with the terms (false: added unscaled, as T5 and ALiBi
    do)."""
    causal: bool = True
    """Causal (query i sees key j iff j <= i + mem_len) or bidirectional."""
    backend: str = "auto"
    """Kernel: auto (FlexAttention on CUDA; on CPU the fastest of the kernels that can take the
    call, measured at first use and cached per machine: kernels/calibration.py) | blocks (query
    blocks, bias rebuilt in backward: O(L·d) memory) | sdpa (SDPA per block with the additive map
    stored) | flex | explicit (materialised) | low_rank (ALiBi, learned ALiBi and FoX as extra
    channels of the flash kernel's heads; calls it cannot take, e.g. with a window, go to blocks) |
    band (a map constant from a distance on — a clamp_len, xl_table's max_distance, T5's last bucket
    —: the pairs beyond it on the causal flash kernel, the band on the block kernel; calls it cannot
    take go to blocks)."""
    query_chunk: int = 256
    """Queries per block; causal blocks skip keys no query of theirs can see (0: one block)."""
    max_stored_scores_mb: int = 0
    """backend 'auto' without a GPU: while the score maps of one layer fit in this many MB they are
    stored for backward (SDPA per block); above it they are rebuilt in backward ('blocks', O(L·d)
    memory). 0: always rebuilt, the memory-safe default (storing trades memory for the rebuild:
    docs/performance.md)."""

    def __post_init__(self):
        if not isinstance(self.terms, str) or not self.terms:
            raise ConfigError(
                "terms",
                f"{self.terms!r}: must be a non-empty subset of 'abcd', e.g. 'abcd' or 'ac'",
            )
        bad = sorted(set(self.terms) - set("abcd"))
        if bad:
            raise ConfigError(
                "terms", f"{self.terms!r} has {bad[0]!r}; only the letters a, b, c, d are allowed"
            )
        if self.terms != "".join(sorted(set(self.terms))):
            raise ConfigError(
                "terms", f"{self.terms!r}: list each letter once, in the order abcd (e.g. 'ac')"
            )
        check_choice("rel", self.rel, REL_SOURCES)
        if self.clamp_len is not None:
            check_range("clamp_len", self.clamp_len, low=1)
        if self.rel == "learned" and self.clamp_len is None:
            raise ConfigError(
                "clamp_len", "rel='learned' needs a table size; set clamp_len (Shaw et al. use 20)"
            )
        check_bias("bias", self.bias)
        check_range("num_buckets", self.num_buckets, low=2 if self.causal else 4)
        check_range("max_distance", self.max_distance, low=1)
        if self.bias == "t5":
            exact = self.num_buckets // 2 if self.causal else self.num_buckets // 4
            if self.max_distance <= exact:
                raise ConfigError(
                    "max_distance", f"t5 needs max_distance > {exact} (the exact buckets)"
                )
        check_choice("absolute", self.absolute, ABSOLUTE_TYPES)
        check_range("max_position", self.max_position, low=1)
        check_choice("positions", self.positions, POSITIONS)
        if self.eval_positions is not None:
            check_choice("eval_positions", self.eval_positions, POSITIONS)
        check_choice("randomized_draw", self.randomized_draw, RANDOMIZED_DRAWS)
        for i, name in enumerate(self.term_schemes):
            check_term(f"term_schemes[{i}]", name)
            if name in BUILTIN_TERMS:  # (its own field carries its settings and checks)
                raise ConfigError(
                    f"term_schemes[{i}]",
                    f"{name!r} is built in: switch it on with {BUILTIN_TERMS[name].switch}",
                )
        if len(set(self.active_terms)) < len(self.active_terms):
            raise ConfigError(
                "term_schemes", f"{self.term_schemes!r}: each term scheme may appear once"
            )
        if self.randomized and self.randomized_draw == "per_layer" and reads_query_position(self):
            raise ConfigError(
                "randomized_draw",
                f"per_layer draws the distances of relative encodings, and "
                f"{self.bias!r} also reads the query position; use shared_positions",
            )
        check_range("rope_base", self.rope_base, low=1.0)
        if self.absolute == "rope" and self.terms != "a":
            raise ConfigError(
                "absolute", f"'rope' rotates q and k of term a; use terms='a' (got {self.terms!r})"
            )
        if self.shaw_values and self.rel != "learned":
            raise ConfigError(
                "shaw_values", "value embeddings index the learned table; set rel='learned'"
            )
        check_choice("score_scale", self.score_scale, SCORE_SCALES)
        check_choice("backend", self.backend, BACKENDS)
        check_range("query_chunk", self.query_chunk, low=0)
        check_range("max_stored_scores_mb", self.max_stored_scores_mb, low=0)
        check_newer_schemes(self)
        check_materialised_schemes(self)
        self.check_options()

    @property
    def active_terms(self) -> tuple[str, ...]:
        """The term schemes this attention adds, in the order of the sum: those switched on by
        their own field, then term_schemes."""
        return (*switched_terms(self), *self.term_schemes)

    @property
    def needs_scores(self) -> bool:
        """Whether a scheme reads the materialised scores (stick-breaking, PaTH, DAPE): the
        per-block path."""
        return self.normaliser != "softmax" or self.path or self.dape != "none"

    @staticmethod
    def field_choices(name: str) -> tuple[str, ...] | None:
        """Allowed values of a field whose list lives in a registry (`--help` appends them)."""
        return bias_types() if name == "bias" else None

    @property
    def randomized(self) -> bool:
        """Randomized positions in training or at evaluation."""
        return "randomized" in (self.positions, self.eval_positions)

    @property
    def uses_r(self) -> bool:
        """Terms b or d need the relative position vectors R."""
        return "b" in self.terms or "d" in self.terms

    @property
    def reads_queries(self) -> bool:
        """Terms a or b read the query q_i (CoPE and RoPE need term a); c and d use u and v
        instead."""
        return "a" in self.terms or "b" in self.terms

    @property
    def reads_keys(self) -> bool:
        """Terms a or c read the key k_j (CoPE needs term a); b and d read W_R R instead."""
        return "a" in self.terms or "c" in self.terms
