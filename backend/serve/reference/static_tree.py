"""SGLang's EAGLE tree on the static decoder, as fixed-shape tensor ops: candidates, selection, ancestor masks, accepted path.

The same tree as draft_tree.py's replay (SGLang's `select_top_k_tokens` and `organize_draft_results`), but each piece
is a tensor function of fixed shapes, with no host sync, so a draft round and a verify stay one captured CUDA graph
each. Nodes are the num_draft_tokens - 1 chosen candidates in candidate order (level by level); a verify's row n + 1
is node n, row 0 the root (the last emitted token). parents: a node's parent node, ROOT, or DETACHED (a parent not
chosen, possible only on a tie of scores: never reached).
"""

from __future__ import annotations

import torch

from backend.serve.reference.draft_tree import DETACHED, ROOT


def candidate_depths(num_steps: int, topk: int, device=None) -> torch.Tensor:
    """[candidates]: each candidate's depth below the root: topk at depth 1, then topk^2 per further step."""
    depths = [1] * topk + [d for d in range(2, num_steps + 1) for _ in range(topk * topk)]
    return torch.tensor(depths, dtype=torch.long, device=device)


def level_start(step: int, topk: int) -> int:
    """The first candidate index of the level made by chained step `step` (0-based; depth step + 2)."""
    return topk + step * topk * topk


def expand_beams(beam_scores: torch.Tensor, child_probs: torch.Tensor, child_ids: torch.Tensor, topk: int):
    """One step of SGLang's beams: every beam's top-k children scored parent x child; returns the level's candidate
    scores and ids (flattened beam-major), the kept beams' flat indices, scores and ids."""
    scores = (beam_scores[:, None] * child_probs).flatten()
    ids = child_ids.flatten()
    kept_scores, kept = scores.topk(topk)
    return scores, ids, kept, kept_scores, ids.index_select(0, kept)


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
