"""The kernel machinery: how one attention call is computed, apart from what its schemes mean.

The contract, for every backend here: given the folded content queries q̃ [B, H, L, dh], keys k and
values v [B, H, S + K, dh] (S learned sink slots first), the scale s and one `AttentionCall`
(call.py),

    out = softmax_over_visible_keys( s·q̃·kᵀ + map ) · v        [B, H, L, dh]

where `map` [B or 1, H, L, K] is everything the call adds to the content scores (term b, term d, the
bias, FoX's decay, CoPE; times the query scale): block by block, `call.sum_terms` of
`AttentionCall.additive_terms` (each term's dense block, built from the call's one carrier of
tensors, `ScoreInputs`), and the visible keys are the call's `Visibility` (causal, memory, window)
and key padding. A query that sees no key gets 0. The backends (dispatch.py picks one): plain SDPA
(no map), SDPA per query block with the stored map, the block kernel that rebuilds each block's map
in backward (blockwise.py with block_maps.py), the low-rank kernel where the map is a key offset up
to a per-query constant (low_rank.py: ALiBi, FoX), the band kernel where the map is constant from a
distance on (band.py: the pairs beyond it on the causal flash kernel, the band on the block kernel,
whose call band.py derives from the call: the one call described twice), FlexAttention (flex.py, the
map as a point-wise `score_mod`), explicit probabilities per block (statistics), and the
materialised path (explicit.py, which takes the summed score map itself, for the whole call or per
query block). The schemes that read the scores themselves are not bent into `map`: they use the
materialised path's three seams — the normaliser (stick-breaking replaces the softmax), the logit
product (PaTH replaces q·kᵀ) and a transform of the summed scores (DAPE) — and never reach the fused
backends. shift.py lays per-distance tensors out per key; geometry.py holds the types call.py,
cope.py and diagnostics.py share; calibration.py times the candidate kernels of a call at first use
and remembers the fastest per machine.

The schemes (`model/position/`, fox.py, cope.py, sinks.py, temperature.py) import nothing from here:
the attention module (attention.py) hands their tensors to the call.
"""
