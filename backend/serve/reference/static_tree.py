"""SGLang's EAGLE tree on the static decoder, as fixed-shape tensor ops: candidates, selection, ancestor masks, accepted path.

One tree for the static decoder's rounds and draft_tree.py's replay (SGLang's `select_top_k_tokens` and
`organize_draft_results`): each piece is a tensor function of fixed shapes, with no host sync, so a draft round and a
verify stay one captured CUDA graph each; the two callers differ only in how they run a draft step (grow_tree's
`step`). Nodes are the num_draft_tokens - 1 chosen candidates in candidate order (level by level); a verify's row n + 1
is node n, row 0 the root (the last emitted token). parents: a node's parent node, ROOT, or DETACHED (a parent not
chosen, possible only on a tie of scores: never reached).
"""

from __future__ import annotations

from typing import Callable

import torch

ROOT = -1  # a node's parent when it hangs off the root (the last emitted token)
DETACHED = -2  # a chosen node whose parent was not chosen (a tie in scores): verification never reaches it


def candidate_depths(num_steps: int, topk: int, device=None) -> torch.Tensor:
    """[candidates]: each candidate's depth below the root: topk at depth 1, then topk^2 per further step."""
    depths = [1] * topk + [d for d in range(2, num_steps + 1) for _ in range(topk * topk)]
    return torch.tensor(depths, dtype=torch.long, device=device)


def level_start(step: int, topk: int) -> int:
    """The first candidate index of the level made by chained step `step` (0-based; depth step + 2)."""
    return topk + step * topk * topk


def grow_tree(
    first_logits: torch.Tensor,
    hidden: torch.Tensor,
    step: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    num_steps: int,
    topk: int,
    nodes: int,
    beam_axis: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's tree from the draft's logits at the last committed row (first_logits [Vd]) and that row's output
    expanded to topk beams (`hidden`, the beams along beam_axis): the top-k first tokens are the beams; chained step i
    runs as step(i, the beams' draft ids [topk], hidden) -> (out, logits [topk, Vd]), every beam's top-k children are
    scored parent x child and the best k kept (their parents' outputs become `hidden`). Returns the `nodes` best
    candidates of all levels (choose_nodes), their draft ids, parent nodes and scores."""
    beam_scores, beam_ids = torch.softmax(first_logits.float(), dim=-1).topk(topk)
    scores, ids = [beam_scores], [beam_ids]
    parents = [torch.full((topk,), ROOT, dtype=torch.long, device=beam_ids.device)]
    beams = torch.arange(topk, device=beam_ids.device)
    for index in range(num_steps - 1):
        out, logits = step(index, beam_ids, hidden)
        child_probs, child_ids = torch.softmax(logits.float(), dim=-1).topk(topk)  # [beam, child]
        level, level_ids = (beam_scores[:, None] * child_probs).flatten(), child_ids.flatten()
        scores.append(level)
        ids.append(level_ids)
        parents.append(beams.repeat_interleave(topk))
        beam_scores, kept = level.topk(topk)
        beam_ids = level_ids.index_select(0, kept)
        hidden = out.index_select(beam_axis, torch.div(kept, topk, rounding_mode="floor"))
        beams = level_start(index, topk) + kept
    all_scores = torch.cat(scores)
    chosen, node_parents = choose_nodes(all_scores, torch.cat(parents), nodes)
    return chosen, torch.cat(ids).index_select(0, chosen), node_parents, all_scores.index_select(0, chosen)


def choose_nodes(scores: torch.Tensor, parents: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best `nodes` candidates by score, in candidate order, and each one's parent node (ROOT, or DETACHED).
    parents: each candidate's parent candidate (ROOT for depth 1)."""
    chosen = scores.topk(nodes).indices.sort().values
    node_of = torch.full_like(parents, DETACHED).scatter(0, chosen, torch.arange(nodes, device=scores.device))
    parent = parents.index_select(0, chosen)
    return chosen, torch.where(parent >= 0, node_of.index_select(0, parent.clamp(min=0)), parent)


def ancestor_bits(parents: torch.Tensor, num_steps: int) -> torch.Tensor:
    """[nodes] int64: bit m set where node m is the node itself or one of its ancestors (the root aside): what its
    verify row may see of the draft's slots."""
    own = torch.bitwise_left_shift(torch.ones_like(parents), torch.arange(parents.numel(), device=parents.device))
    bits, up = own, parents
    for _ in range(num_steps - 1):
        has = up >= 0
        bits = bits | torch.where(has, own.index_select(0, up.clamp(min=0)), 0)
        up = torch.where(has, parents.index_select(0, up.clamp(min=0)), up)
    return bits


def accepted_path(proposals: torch.Tensor, greedy: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, num_steps: int):
    """Greedy verification of the tree: (accepted count [1], rows [num_steps] of the accepted nodes by depth, 0 past
    the accepted ones). proposals [nodes]: the nodes' tokens; greedy [nodes + 1]: the target's greedy id at each
    verify row. A node is reached when its token is its parent row's greedy id and its parent is reached; siblings
    hold distinct tokens, so the reached nodes are one path."""
    parent_rows = parents + 1  # the root's row 0; a detached node's -1 never matches
    matched = (parent_rows >= 0) & (proposals == greedy.index_select(0, parent_rows.clamp(min=0)))
    reached = matched & (parents == ROOT)
    for _ in range(num_steps - 1):
        reached = matched & torch.where(parents >= 0, reached.index_select(0, parents.clamp(min=0)), parents == ROOT)
    at_depth = reached[None, :] & (depths[None, :] == torch.arange(1, num_steps + 1, device=depths.device)[:, None])
    rows = (at_depth.long() * torch.arange(1, parents.numel() + 1, device=parents.device)[None, :]).sum(1)
    return reached.long().sum().view(1), rows
