"""The ring schedule: forward and backward, for every layout and mask (ops.py makes them
custom ops), by role:

    plan.py      what a call runs: its steps and their block pairs (from the layout), a block
                 mask's plan, the kernel's mask of one pair
    rotate.py    the rotation: ``ring_forward``, ``ring_backward``
    slots.py     the buffers visiting shards arrive in
    gathered.py  the ring of two that keeps the other rank's K/V (``keeps_kv``)
    rows.py      rows of the ring's buffers, and copies beside the kernels

World size W, rank r. At step s the rank holds the K/V shard that started on rank
src = (r - s) mod W. Before computing step s it posts the send of that shard to r+1
and the receive of the next one from r-1, then runs the layout's block pairs for
(r, src) through the local kernel. Merging is the kernel's own epilogue: it merges its
block's softmax state with the running (out, lse), kept in fp32 until the last step, whose
kernels read those sums and write out in q's dtype (dQ, and dK/dV when two steps run, the
same way in the backward). The own shard leaves from k and v themselves; later shards
arrive in one buffer (two active steps: a ring of two, or a wider ring whose window or
local block mask stops the shards after one hop) or two taking turns.

Masks are data on the way: the band on global positions (causal, sliding window) becomes
each pair's band of local indices, or stays on positions where the rows jump
(block_stripe; ``layouts.step_pairs``), the visiting shard's segment
ids travel with its K/V, and dropout is keyed by the pair's global positions, so every
layout and world size drops the same elements as one device. A block mask on global
token blocks is sliced per pair (each pair of contiguous chunks is a rectangle of it), and
chunk pairs it leaves empty are dropped from the schedule. Steps after the last one that
computes anything on any rank are not run at all (``layouts.active_steps``): with a
sliding window or a local block mask the shards stop travelling once no rank further on
can see them. And where the ranks a shard visits see at most half of all shards' rows, a
shard travels as the rows they see (``plan.travelling_rows``): the documents that cross
ranks on a layout computed from them, the last window of keys of contiguous shards.

Backward: the same rotation of K/V, with the own shard split around it: its dQ pass
first (hiding the first K/V trip), its dK/dV pass last. The running fp32 dK/dV of a
visiting shard starts on the rank after its owner and arrives from r-1 during each later
step (it left r-1 once r-1 had finished its previous step): the gradient buffer travels
one step behind the K/V it belongs to. Each step runs the dQ pass first, which needs
nothing in flight and so hides the transfer, then adds the dK/dV pass straight into the
arrived sum. The last trip takes each sum home while the owner runs its own dK/dV pass,
and the owner adds the two. When two steps run and the remote one is large (causal, packed
documents: not a window's sliver), the remote dK/dV pass runs first instead, its dQ pass
hides the trip home, and the own dK/dV pass adds the arrived sum as it writes; both dK/dV
passes run in two halves of key rows (``layouts.step_pieces``), so the first half's sum
travels while the second is computed. dQ never leaves the rank.

Where one kernel computes a pair's dQ and dK/dV together (the Gluon backward on Hopper:
bf16, head_dim 64 or 128, a band on local indices, segment ids, a block mask, dropout on
positions of stride 1 (not with a block mask); none of the last three with
``deterministic``; ``rotate._fuses`` asks ``dispatch.gluon_serves``
from what every rank agrees on, so all choose alike) the backward is fused: each pair is
one call adding dQ into the fp32 dQ and dK/dV into fp32 sums (a pair whose rows are not
whole tiles of 128, as the chunks of a short zigzag shard or the pieces of a document
that a band still cuts, runs as its whole tiles and the rest: ``plan.tile_pieces``; on
Hopper the forward cuts such pairs too). The own step then runs in
pieces of key rows, those of the first half under the first K/V trip, the others under
the trip home, cut also where the rows that travel start and end (``rotate._own_pieces``):
a piece whose rows never travel writes its dK/dV straight into the gradients in k's
dtype, the others their fp32 sums, which meet the sum coming home in one pass
(``kernels.add_rounded``); a visiting step adds into a zeroed buffer of its own while
the running sum arrives, then that buffer into the sum (one add over the rows it
touched), so no kernel waits for a trip; dQ is cast to q's dtype once at the end. A ring of two takes this rotation too.
By default the Gluon kernel's dQ adds land in arrival order; ``deterministic=True`` (or
torch's deterministic mode) makes it add them in a fixed order of key tiles, on the same
fused schedule.

From three active steps on, the direct schedule may run instead (``plan.takes_direct``;
RINGFLASH_SCHEDULE: "auto", the default, where shards travel cut; "rotate"; "direct"): at
the start of each pass every rank sends its own shard straight to each rank that computes
it (shift s for step s) and receives every shard it computes into a slot of its own
(``slots.Slots.send_all``); in the backward each visiting step's dK/dV go into a fresh fp32
partial sum that leaves straight for its owner once the step is done (shift -s), and the
owner adds the arriving sums in step order (``rotate._direct``). No step waits for a
neighbour's running sum, so a short step exposes nothing. Where shards travel cut, each
rank receives only the rows its own pairs see (``plan.routes``; one row where it sees
none), not every row some rank sees, as the rotation must carry: on packed documents of
median 16k over 4 ranks at 512k, 28% fewer bytes for the busiest rank.
Asked to (``keep_received``: ops.py, through torch.distributed in eager calls), the forward
keeps the rows its slots received (``ring_forward``'s ``keep_received``) and the backward receives no K/V: its
remote steps run at once and the own step's passes last, under the sums' trips home.

A ring of two over contiguous shards under a block mask that the Gluon backward does not
serve (``keeps_kv``: off Hopper, with segment ids, dropout or ``deterministic``; where it
serves, the rotation above measured faster) keeps the other rank's K/V from the forward,
which with its own make the whole sequence's (read in place, in global order:
``kernels.Joined``). Its backward swaps queries instead (Q, dO, lse,
delta) under a dQ pass over every key,
then runs one dK/dV pass over every query (``gathered.gathered_backward``): two launches of the
shape one GPU runs, where the rotation above runs six of half the size, whose fixed costs
no longer hide at low density. Holding every key and query, the ranks can also divide
the dK/dV work where the mask makes it even (``plan.SparsePlan.key_cut``). Its forward is one
launch too where the copy engines carry the shard (``gathered.gathered_forward``): the shard
arrives in chunks of heads, and each query tile waits inside the kernel for its head's.
"""

from .gathered import fuses, keeps_kv
from .rotate import ring_backward, ring_forward

__all__ = ["fuses", "keeps_kv", "ring_backward", "ring_forward"]
