"""`dsa-serve bench ep-exchange` at a small shape: the three collective shapes compute the same sums, move the
bytes the arithmetic says, and the JSON names a winner per shape."""

import json

from cluster.cli import main


def test_the_three_exchange_shapes_agree_and_count_their_bytes(capsys):
    argv = ["bench", "ep-exchange", "--sizes", "2", "--rows", "1,8", "--hidden", "64", "--experts", "16",
            "--top-k", "2", "--groups", "4", "--kept-groups", "2", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)  # the result alone on stdout
    assert [(e["cp_size"], e["rows_per_rank"]) for e in result["table"]] == [(2, 1), (2, 8)]
    for entry in result["table"]:
        rows, row_bytes = entry["rows_per_rank"], 64 * 2
        for method in ("gather_scatter", "all_rows_all_to_all", "routed_dispatch"):
            assert entry[method]["max_abs_diff_vs_gather_scatter"] < 0.05  # bf16 sums in another order
        packed = rows * (row_bytes + 8 * 2)  # a row with its 2 expert ids (int32) and weights (fp32)
        assert entry["all_rows_all_to_all"]["bytes_received_per_rank"] == packed + rows * row_bytes
        assert entry["gather_scatter"]["bytes_received_per_rank"] == packed + rows * row_bytes
        assert entry["all_rows_all_to_all"]["collectives"] == 2 and entry["routed_dispatch"]["collectives"] == 3
        assert entry["fastest_comm"] in ("gather_scatter", "all_rows_all_to_all", "routed_dispatch")
    assert "routed dispatch" in result["conclusion"]
