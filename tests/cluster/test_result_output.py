"""A command's stdout holds its result and nothing else (cluster/commands/result_output.py)."""

import json
import threading

from ray._private.worker import print_to_stdstream

from cluster.commands.result_output import print_result, results_only_on_stdout, with_results_only_on_stdout


def test_inside_a_bench_run_only_the_result_reaches_stdout(capsys):
    with results_only_on_stdout():
        print("a library's own line")
        print_result('{"bench": "x"}')
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"bench": "x"}
    assert "a library's own line" in captured.err


def test_rays_forwarded_cluster_errors_go_to_stderr_even_from_its_listener_thread(capsys):
    """Ray's driver prints the cluster's error messages (e.g. "(raylet) Task ServeController.graceful_shutdown
    failed ...", seen at the top of a `bench serve --workload long --json` file) to stdout from a thread."""

    def ray_listener_prints():
        print_to_stdstream({"lines": ["Task ServeController.graceful_shutdown failed"], "pid": "raylet",
                            "is_err": False}, ignore_prefix=False)

    @with_results_only_on_stdout
    def run_bench(args):
        thread = threading.Thread(target=ray_listener_prints)
        thread.start()
        thread.join()
        print_result(json.dumps({"bench": args}))
        return 0

    assert run_bench("serve") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"bench": "serve"}
    assert "graceful_shutdown failed" in captured.err


def test_outside_a_bench_run_print_result_is_a_plain_print(capsys):
    print_result("plain")
    assert capsys.readouterr().out == "plain\n"
