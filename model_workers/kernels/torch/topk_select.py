"""Exact top-k over long score rows, narrowed by group maxima before the selection.

`torch.topk` of 64 over an 8192-key row costs about 3.4 ns per key on one CPU thread (it copies every
(value, index) pair before selecting), as long as the indexer's scoring product itself. Here the keys of a row
are split into GROUPS_PER_PICK * k strided groups (key s in group s mod G, so neighbouring keys, whose scores are
alike, fall in different groups), and only the k groups with the largest maxima are kept. No key outside them
can be in the top k: a key above the k-th largest group maximum tau would make its own group's maximum larger
than tau, and each kept group holds a key >= tau, so the k largest values all lie in the kept groups. That
shrinks the row GROUPS_PER_PICK-fold with one max pass and one small selection; it repeats until rows are short.

The values returned equal `torch.topk`'s exactly and in its order, largest first (so the k-th value that
`earliest_topk` breaks ties on is exact); which of several keys tied at the k-th value are picked is as
unspecified as it is for `torch.topk`.
"""

from __future__ import annotations

import torch

GROUPS_PER_PICK = 4  # each round keeps 1/4 of a row (k of 4k groups)
MIN_GROUP_SIZE = 4  # rows shorter than 4k groups x 4 keys are selected directly
MIN_ELEMENTS = 64 * 2048  # fewer scores in all than this: the rounds' fixed costs outweigh the saving


def row_topk(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [R, width] of the `width` largest of each row of scores [R, n], largest first.

    Equal to `scores.topk(width, dim=-1)` (the order too, so the attention that sums over the picked keys adds
    them in the same order whatever the row's length), up to which keys tied at the k-th value are picked.
    """
    num_rows, num_keys = scores.shape
    if num_rows * num_keys < MIN_ELEMENTS:
        return scores.topk(width, dim=-1)
    return narrowed_topk(scores, width)


def narrowed_topk(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """row_topk without the size check: rounds of `kept_groups` while rows are long enough to gain."""
    num_groups = GROUPS_PER_PICK * width
    if scores.shape[1] < num_groups * MIN_GROUP_SIZE:
        return scores.topk(width, dim=-1)  # the last round: largest first
    kept, groups = kept_groups(scores, width, num_groups)  # [R, n'] with n' about n / GROUPS_PER_PICK; [R, width]
    values, picked = narrowed_topk(kept, width)  # [R, width] each, picked = places in kept
    return values, kept_columns(picked, groups, num_groups, scores.shape[1])


def kept_groups(scores: torch.Tensor, width: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [R, group_size * width + tail] of the `width` strided groups of each row with the largest maxima
    (place i * width + j: key i * G + groups[j]), then the tail keys past the last whole stride (in no group, so
    always kept); and those groups [R, width]. scores [R, n]."""
    num_rows, num_keys = scores.shape
    whole = num_keys - num_keys % num_groups
    strided = scores[:, :whole].view(num_rows, whole // num_groups, num_groups)  # [R, group_size, G]
    groups = strided.amax(dim=1).topk(width, dim=-1, sorted=False).indices  # [R, width]: group j = keys j mod G
    kept = strided.gather(2, groups[:, None, :].expand(-1, strided.shape[1], -1)).view(num_rows, -1)
    if whole < num_keys:
        kept = torch.cat([kept, scores[:, whole:]], dim=1)
    return kept, groups


def kept_columns(places: torch.Tensor, groups: torch.Tensor, num_groups: int, num_keys: int) -> torch.Tensor:
    """Places [R, k] in `kept_groups`' scores -> the columns [R, k] of the row they came from."""
    width = groups.shape[1]
    whole = num_keys - num_keys % num_groups
    grouped_places = (whole // num_groups) * width  # places before the tail
    grouped = (places // width) * num_groups + groups.gather(1, places % width)  # [R, k]
    return torch.where(places >= grouped_places, places - grouped_places + whole, grouped)
