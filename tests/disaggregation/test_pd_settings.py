"""Disaggregation settings at the edge: the serve flags become ServeAppArgs, each kind of group gets its own rank
count, EP and node resource, the app's Ray CPUs count both kinds, and a colocated placement is refused."""

from __future__ import annotations

import pytest

from cluster import cli
from cluster.commands.serve import app_args, app_cpus, engine_replicas
from cluster.replica_engine import engine_bundles
from cluster.serve_app import validate_args


def parsed(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def test_serve_flags_make_a_disaggregated_app():
    flags = parsed("--pd-disaggregation", "--prefill-cp-size", "2", "--decode-dp-size", "2", "--ep-size", "2",
                   "--prefill-replicas", "3", "--decode-replicas", "2", "--pd-min-prefill-tokens", "64")
    args = app_args(flags)
    assert args.pd_disaggregation and args.prefill_replicas == 3 and args.pd_min_prefill_tokens == 64
    prefill, decode = args.group_args("prefill"), args.group_args("decode")
    assert (prefill.cp_size, prefill.ep_size, decode.cp_size, decode.ep_size) == (2, 2, 2, 2)
    assert not prefill.pd_disaggregation and not decode.pd_disaggregation
    assert engine_replicas(flags) == 2
    assert app_cpus(args, 2) == 1 + 2 * (1 + 2) + 3 * (1 + 2)  # ingress, decode groups, prefill groups


def test_group_sizes_default_and_ep_follows_each_group():
    args = validate_args({"cp_size": 4, "pd_disaggregation": True, "prefill_node_resource": "dsa_prefill"})
    assert args.group_args("prefill").cp_size == 4 and args.group_args("decode").cp_size == 1
    assert args.group_args("decode").ep_size == 1
    assert engine_bundles(args.group_args("prefill"))[0] == {"CPU": 1, "dsa_prefill": 1}
    assert engine_bundles(args.group_args("decode"))[0] == {"CPU": 1}


def test_disaggregation_needs_the_separate_placement():
    with pytest.raises(ValueError, match="pd_disaggregation .*needs engine_placement separate, got 'colocated'"):
        validate_args({"pd_disaggregation": True, "engine_placement": "colocated"})
