"""Expert parallelism: which rank owns which experts, and the engines that move tokens to them and back.

Data flow: `ownership` (contiguous expert ranges, the per-rank expert map, owner of each id) ->
`engines` (dispatch -> this rank's experts -> combine, on `torch.distributed`) -> `cost` (bytes each
engine moves and a latency + bandwidth model of its time, whose per-collective constants `constants`
loads from measured tables under `tables/`).
"""
