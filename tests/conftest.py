"""What ``make test-quick`` leaves out, and ``--shuffle-seed N``.

``make test`` runs every test of the package (``pytest -m "not command"``);
``make test-commands`` the tests marked ``command``, each of which runs a
whole command of the repository (the demos, the bench studies at their
smoke sizes); CI runs both. ``make test-quick`` (``pytest -m "not slow"``)
runs every module of the package in under 3 minutes on 2 cores: a
``command`` test is ``slow`` too, and besides the tests marked ``slow`` in
their own files (trainers on real ranks), :data:`QUICK_LEAVES_OUT` marks the
variants of a test whose first variant already runs the same code quickly.

``--shuffle-seed N`` runs the collected tests in a seeded random order, to
show that none needs another first. No plugin: the order is
``random.Random(N).shuffle`` of the collected items, printed in the header so
that a failing order can be run again.
"""

from __future__ import annotations

import fnmatch
import random

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shuffle-seed",
        type=int,
        default=None,
        help="run the collected tests in the order random.Random(N).shuffle gives (tests/conftest.py)",
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle-seed")
    return None if seed is None else f"tests shuffled with --shuffle-seed {seed}"


# Node-id patterns (fnmatch) marked slow, by why the quick run can do without them.
QUICK_LEAVES_OUT = (
    # The 8- and 16-rank layouts: the 4-rank ones run the same path on real ranks.
    "tests/test_layouts.py::test_layout[[]*-8ranks[]]",
    # The same trace at 64 and 512 fake ranks: the 8-rank variant traces every layout.
    "tests/test_compile_fake_pg.py::test_fullgraph_all_layouts_every_norm_type_one_all_reduce[[]64[]]",
    "tests/test_compile_fake_pg.py::test_fullgraph_all_layouts_every_norm_type_one_all_reduce[[]512[]]",
    "tests/test_compile_fake_pg.py::test_pp_mesh_on_the_1d_root_mesh_compiles_to_one_graph_one_all_reduce[[]512[]]",
    "tests/test_compile_fake_pg.py::test_every_rank_of_the_world_mesh_traces_the_same_graph[[]512-*",
    # Each compiled step written back, one form in the quick run.
    "tests/test_write_back.py::test_a_compiled_step_returning_only_its_loss_keeps_the_eager_state[[]*",
    "tests/test_write_back.py::test_the_same_step_with_a_hand_written_copy_is_wrong_where_torch_reorders[[]functional[]]",
    "tests/test_inductor_code.py::test_the_clip_is_computed_once_not_in_every_leafs_update[[]nonfinite_zero[]]",
    "tests/test_inductor_code.py::test_the_clip_is_computed_once_not_in_every_leafs_update[[]adaptive_skip[]]",
    "tests/test_functional_train_step.py::test_the_script_runs",
    "tests/test_functional_train_step.py::test_the_step_written_back_in_place_as_docs_cuda_graphs_captures_it",
    "tests/test_compile_dynamic.py::test_functional_zclip_step_with_a_changing_batch",
    "tests/test_record.py::test_a_compiled_step_records_what_the_eager_step_records",
    # Inductor's code per dtype and norm: float32 and p=2 in the quick run.
    "tests/test_traced_statistics.py::*[[]torch.bfloat16-*",
    "tests/test_traced_statistics.py::*[[]*-1.0[]]",
    # Two torch threads: the quick run takes one.
    "tests/test_local_statistics.py::*[[]2thread*",
    # The longest cases of the shared 4-rank run (pp_ddp and stages_without_grads stay; the checkpoint and the
    # failure path are tested on one process too).
    "tests/test_layouts.py::test_layout[[]partial_grads-4ranks[]]",
    "tests/test_layouts.py::test_layout[[]interleaved_pp_fsdp2-4ranks[]]",
    "tests/test_layouts.py::test_layout[[]tied_embedding-4ranks[]]",
    "tests/test_checkpoint.py::test_on_real_ranks[[]*",
    "tests/test_agree_ranks.py::test_on_real_ranks[[]an_adagc_state_that_differs_on_one_rank[]]",
    "tests/test_reliability_ranks.py::test_on_real_ranks[[]under_compile_a_failing_rank_releases_its_peers[]]",
    "tests/test_exact_ranks.py::test_on_real_ranks[[]a_compiled_abort_stops_every_rank_too[]]",
    "tests/test_compile_fake_pg.py::test_fullgraph_each_layout_alone_one_all_reduce",
    # Lightning on real ranks (its options, checks and import are tested on one process), and each of its
    # packages alone in a subprocess.
    "tests/test_lightning.py::test_on_real_ranks[[]*",
    "tests/test_lightning_packages.py::test_on_real_ranks[[]*",
    "tests/test_lightning_packages.py::test_one_package_alone[[]*",
    # The wheel built and installed into a fresh venv; the compiled step again on a 64-rank world mesh.
    "tests/test_wheel.py::test_wheel_installs_into_a_fresh_venv_and_clips",
    "tests/test_compile_fake_pg.py::test_every_rank_of_the_world_mesh_traces_the_same_graph[[]64-*",
    "tests/test_compile_train_step.py::test_compiled_step_on_a_world_mesh_holds_one_collective",
    # One of each pair of commands run in a subprocess.
    "tests/test_plot.py::test_command_defaults_to_the_record_name",
    "tests/test_plot.py::test_empty_file_is_a_clear_error",
    "tests/test_functional_train_step.py::test_the_written_back_step_reads_nothing_on_the_host_and_writes_the_state_once",
    # The harness's own hang test (a rank killed by its timeout).
    "tests/test_harness_cases.py::test_a_rank_that_skips_a_collective_does_not_hang_its_peer",
)
# The one variant of a pattern above that the quick run keeps.
QUICK_KEEPS = (
    "tests/test_write_back.py::test_a_compiled_step_returning_only_its_loss_keeps_the_eager_state[[]zclip-fullgraph[]]",
)


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.get_closest_marker("command") is not None:
        item.add_marker(pytest.mark.slow)  # a whole command is slow too
    node = item.nodeid
    if any(fnmatch.fnmatchcase(node, p) for p in QUICK_LEAVES_OUT) and not any(
        fnmatch.fnmatchcase(node, p) for p in QUICK_KEEPS
    ):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        random.Random(seed).shuffle(items)
