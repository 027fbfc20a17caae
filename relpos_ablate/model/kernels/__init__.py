"""The kernel machinery: how one attention call is computed, apart from what its schemes mean.

The contract, for every backend here: given the folded content queries q̃ [B, H, L, dh], keys k and
values v [B, H, S + K, dh] (S learned sink slots first), the scale s and one `AttentionCall`
(core/call.py),
    out = softmax_over_visible_keys( s·q̃·kᵀ + map ) · v        [B, H, L, dh]
where `map` [B or 1, H, L, K] is everything the call adds to the content scores (its per-distance
tensors: term b, term d, a bias of distance alone; its score terms; times the query scale): block by
block, `call.sum_terms` of `AttentionCall.additive_terms`, and the visible keys are the call's
`Visibility` (causal, memory, window) and key padding. A query that sees no key gets 0. A kernel
asks the call's parts for a *form* (core/terms.py), never for a scheme, and which kernels can take
a call is the planner's answer from those forms (relpos_ablate/planner.py). The backends
(dispatch.py picks one): plain SDPA (no map), SDPA per query block with the stored map, the block
kernel that rebuilds each block's map in backward (blockwise.py, with block_maps.py and
materialised_maps.py), the low-rank kernel where every part is a key offset up to a per-query
constant (low_rank.py, key_offset_attention.py), the band kernel where the map is constant from a
distance on (band.py: the pairs beyond it on the causal flash kernel, the band on the block
kernel), FlexAttention (flex.py, the map as a point-wise `score_mod`), explicit probabilities per
block (statistics), and the materialised path (explicit.py, which takes the summed score map
itself, for the whole call or per query block, with its normaliser and values per distance). The
schemes that read the scores themselves use the materialised path's seams (a normaliser, the logit
product, a transform of the summed scores) and never reach the fused backends; calibration.py
times the candidate kernels of a call at first use and remembers the fastest per machine.

Nothing here imports a scheme (model/schemes/) or the configuration (relpos_ablate/config/).
"""
