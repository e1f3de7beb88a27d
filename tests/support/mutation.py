"""`make mutation`: mutmut over one module at a time, with only the tests that cover it.

    python -m tests.support.mutation kvflow/core/tiers/diskfile.py   # one module
    python -m tests.support.mutation                                 # every module in MODULES

For each module this copies the working tree (git's tracked and untracked-but-not-ignored
files) into a scratch folder outside the repo ($KVFLOW_MUTATION_DIR, default
/tmp/kvflow-mutation/<module>), appends a [tool.mutmut] table to that copy's pyproject.toml
(mutate only this module; test selection: its tests from TESTS_BY_MODULE) and runs
`mutmut run` there. mutmut (3.x) first runs the selected tests once to record which test
reaches which function, then runs each mutant against only those tests. Nothing is written
into the repo. The summary line per module is what docs/TESTING.md records; the survivors are
listed (and written to <folder>/survivors.txt); `mutmut show <name>` in the folder shows one.
After adding tests, `--recheck` (make mutation RECHECK=1) reruns only the mutants the last run
of a module left alive, against the repo's current tests, and prints the new score.

On a machine with more cores, `--jobs N` (make mutation JOBS=N) mutates N modules at once, each
in its own folder with its output in <folder>/mutmut.log; `--resume` keeps a module's folder and
lets mutmut go on where an interrupted run stopped; `--progress` prints every module's counts so
far (from the folders) without running anything. `--seed DIR` (make mutation SEED=DIR) starts
each new folder from the verdicts an earlier run left in DIR, say one copied back from a machine
that was taken away: mutmut keeps those of unchanged functions and runs the rest.

Score = (killed + timeout) / (total - skipped). "no tests" mutants (code no selected test
reaches) count as not killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.support import mutation_hits

REPO = Path(__file__).resolve().parents[2]

#: the Redis tier's tests: they cover redis.py and the modules split out of it (issue 40)
REDIS_TESTS = [
    "tests/core/tiers/test_redis.py",
    "tests/core/tiers/test_redis_faults.py",
    "tests/core/tiers/test_redis_cluster.py",
    "tests/core/tiers/test_redis_behaviour.py",
    "tests/core/tiers/test_redis_cluster_nodes.py",
    "tests/core/tiers/test_redis_construction.py",
    "tests/core/tiers/test_redis_info.py",
    "tests/core/tiers/test_redis_io.py",
    "tests/core/tiers/test_redis_recorded_errors.py",
    "tests/core/tiers/test_redis_mutants.py",
    "tests/core/tiers/test_tier_contract.py",
]

#: the layerwise paths' CPU tests through a real server, and the ring's bookkeeping
LAYERWISE_TESTS = [
    "tests/core/server/test_layerwise_server.py",
    "tests/core/server/test_staging_server.py",
    "tests/core/server/test_staging.py",
]

# The modules issue 23 names (engine, tiers, server, bus), each with the CPU tests that
# exercise it. A module missing here gets the test_<name>*.py files of its mirrored tests
# folder (kvflow/core/tiers/disk.py -> tests/core/tiers/test_disk*.py), or the whole folder.
TESTS_BY_MODULE: dict[str, list[str]] = {
    # The stream stamper (tests/events/test_stream.py) drives the bus's reservation API.
    "kvflow/events/bus.py": ["tests/events", "tests/core/engine/test_engine_events.py"],
    "kvflow/core/tiers/diskfile.py": [
        "tests/core/tiers/test_disk.py",
        "tests/core/tiers/test_disk_faults.py",
        "tests/core/tiers/test_diskfile_format.py",
    ],
    "kvflow/core/tiers/disk.py": [
        "tests/core/tiers/test_disk.py",
        "tests/core/tiers/test_disk_faults.py",
        "tests/core/tiers/test_disk_tier_behaviour.py",
        "tests/core/tiers/test_disk_construction.py",
        "tests/core/tiers/test_tier_contract.py",
    ],
    "kvflow/core/tiers/l1.py": [
        "tests/core/tiers/test_l1.py",
        "tests/core/tiers/test_l1_resize.py",
        "tests/core/tiers/test_l1_mutants.py",
        "tests/core/tiers/test_quota.py",
        "tests/core/tiers/test_pinahead.py",
        "tests/core/tiers/test_tier_contract.py",
        # `pinning_paused`: the engine's and the server's registrations pause the pinning
        "tests/core/engine/test_engine_pin_ahead.py",
        "tests/core/server/test_server_pin_ahead.py",
    ],
    "kvflow/core/tiers/base.py": [
        "tests/core/tiers/test_base.py",
        "tests/core/tiers/test_tier_contract.py",
        "tests/core/engine/test_engine_l2.py",
    ],
    "kvflow/core/tiers/sharding.py": [
        "tests/core/tiers/test_sharding.py",
        "tests/core/tiers/test_sharding_errors.py",
    ],
    "kvflow/core/tiers/hostmem.py": [
        "tests/core/tiers/test_hostmem.py",
        "tests/core/tiers/test_l1.py",
        "tests/core/tiers/test_tier_contract.py",
        # `release_segment`: L1 shrinking gives its segments back
        "tests/core/tiers/test_l1_resize.py",
        "tests/core/tiers/test_l1_mutants.py",
    ],
    # the layerwise retrieve's copies straight into blocks: planned and run on CPU memory
    "kvflow/core/engine/direct.py": ["tests/core/engine/test_direct.py"],
    # L1's free space: its own tests, and L1's (which allocate, evict, shrink through it)
    "kvflow/core/tiers/l1space.py": [
        "tests/core/tiers/test_l1space.py",
        "tests/core/tiers/test_l1.py",
        "tests/core/tiers/test_l1_resize.py",
        "tests/core/tiers/test_l1_mutants.py",
    ],
    # the CPU mover's copy list and the torch reference every CPU path is checked against
    "kvflow/kernels/reference.py": [
        "tests/kernels/test_kernel_chunks.py",
        "tests/kernels/test_kernel_reference.py",
    ],
    "kvflow/core/tiers/pinahead.py": [
        "tests/core/tiers/test_pinahead.py",
        "tests/core/server/test_probes.py",
        # `paused`: the engine's and the server's registrations hold the growth
        "tests/core/engine/test_engine_pin_ahead.py",
        "tests/core/server/test_server_pin_ahead.py",
    ],
    "kvflow/core/tiers/redis.py": REDIS_TESTS,
    "kvflow/core/tiers/redisformat.py": REDIS_TESTS,
    "kvflow/core/tiers/redislink.py": REDIS_TESTS,
    "kvflow/core/tiers/redisnodes.py": REDIS_TESTS,
    "kvflow/core/tiers/redisstats.py": REDIS_TESTS,
    "kvflow/core/tiers/redis_target.py": ["tests/core/tiers/test_redis_target.py"],
    "kvflow/core/server/protocol.py": [
        "tests/core/server/test_protocol.py",
        "tests/core/server/test_fuzz.py",
        "tests/core/server/test_server_hardening.py",
    ],
    "kvflow/core/server/shm.py": ["tests/core/server/test_shm.py"],
    # the engine's staging ring and the layer completion points it rides on (issue 35)
    "kvflow/core/server/staging.py": LAYERWISE_TESTS,
    "kvflow/core/server/layers.py": LAYERWISE_TESTS,
    "kvflow/core/polling.py": [*LAYERWISE_TESTS, "tests/core/test_polling.py"],
    "kvflow/core/server/curve.py": [
        "tests/core/server/test_curve.py",
        "tests/core/server/test_curve_keys.py",
    ],
    "kvflow/core/server/cli.py": ["tests/core/server/test_server_cli.py"],
    # a sharded server: how its front splits queries and joins replies, and the front itself
    "kvflow/core/server/fanout.py": [
        "tests/core/server/test_fanout.py",
        "tests/core/server/test_sharded.py",
    ],
    "kvflow/core/server/shards.py": [
        "tests/core/server/test_fanout.py",
        "tests/core/server/test_sharded.py",
    ],
    "kvflow/core/server/client.py": [
        "tests/core/server/test_client.py",
        "tests/core/server/test_server.py",
        "tests/core/server/test_server_events.py",
        "tests/core/server/test_blend_server.py",
        "tests/core/server/test_layerwise_server.py",
        "tests/core/server/test_kv_events.py",
        "tests/core/server/test_admin.py",
        "tests/core/server/test_client_mutants.py",
        "tests/core/server/test_chunk_keys.py",
        # the CURVE handshake's failures (`_check_handshake`)
        "tests/core/server/test_curve.py",
        # clients of an IPv6 endpoint connect with ZMQ's IPv6 option (`_checkout`)
        "tests/core/server/test_server_hosts.py",
        # the CUDA events of stores and retrieves (make mutation GPU=1 on a GPU machine)
        "tests/core/server/test_layerwise_gpu.py",
    ],
    # the server's admin calls, KV-event publisher and probes have test files of their own
    "kvflow/core/server/server.py": [
        "tests/core/server/test_server.py",
        "tests/core/server/test_server_hardening.py",
        "tests/core/server/test_server_shutdown.py",
        "tests/core/server/test_server_events.py",
        "tests/core/server/test_server_gpu.py",
        "tests/core/server/test_admin.py",
        "tests/core/server/test_kv_events.py",
        "tests/core/server/test_probes.py",
        "tests/core/server/test_server_mutants.py",
        # an unregister gives up the instance's layerwise store waiting for its layers
        "tests/core/server/test_layerwise_server.py",
        # --host: IPv6, host names, every interface
        "tests/core/server/test_server_hosts.py",
        # registrations with RoPE parameters (blend)
        "tests/core/server/test_blend_server.py",
        # the process's switch interval in status()
        "tests/core/server/test_server_cli.py",
        # who may re-register or take over an instance under CURVE
        "tests/core/server/test_curve.py",
    ],
    # split out of server.py (issue 40): the jobs run every request kind; the registry
    # keeps the registered instances
    # every request a server runs goes through a job: the salted, keyed and ranked
    # lookups, stores and retrieves are in the client's and the mutant-killing files too
    "kvflow/core/server/jobs.py": [
        "tests/core/server/test_jobs.py",
        "tests/core/server/test_server.py",
        "tests/core/server/test_server_hardening.py",
        "tests/core/server/test_blend_server.py",
        "tests/core/server/test_layerwise_server.py",
        "tests/core/server/test_chunk_keys.py",
        "tests/core/server/test_client.py",
        "tests/core/server/test_client_mutants.py",
        "tests/core/server/test_server_mutants.py",
        "tests/core/server/test_server_events.py",
        "tests/core/server/test_kv_events.py",
        "tests/core/server/test_admin.py",
        "tests/e2e/test_server_l2.py",
        # a registration of CUDA caches between L1's segments, one of shared memory at once
        "tests/core/server/test_server_pin_ahead.py",
        # the CUDA events of registrations and early replies (GPU=1 on a GPU machine)
        "tests/core/server/test_layerwise_gpu.py",
        "tests/core/server/test_server_gpu.py",
    ],
    "kvflow/core/server/registry.py": [
        "tests/core/server/test_server.py",
        "tests/core/server/test_server_hardening.py",
        "tests/core/server/test_server_shutdown.py",
    ],
    # CUDA IPC: only the gpu-marked tests reach it (make mutation GPU=1 on a GPU machine).
    "kvflow/core/server/ipc.py": [
        "tests/core/server/test_server_gpu.py",
        "tests/e2e/test_server_reuse.py",
    ],
    "kvflow/core/server/sharing.py": [
        "tests/core/server/test_server.py",
        "tests/core/server/test_shm.py",
        "tests/core/server/test_server_gpu.py",
    ],
    "kvflow/core/engine/keys.py": ["tests/core/engine/test_keys.py"],
    "kvflow/core/engine/request.py": ["tests/core/engine/test_request.py"],
    "kvflow/core/engine/observability.py": ["tests/core/engine/test_observability.py"],
    # the engine's layer-wait report and its check: the engine's tests and the server's
    # layerwise tests call them
    "kvflow/core/engine/cache_engine.py": [
        "tests/core/engine",
        "tests/core/server/test_layerwise_server.py",
        "tests/observe/test_top_layer_waits.py",
    ],
    "kvflow/core/engine/validation.py": [
        "tests/core/engine",
        "tests/core/server/test_layerwise_server.py",
    ],
    # the planner: its CPU tests emulate the kernel's addressing from the packed table
    "kvflow/kernels/plan.py": ["tests/kernels/test_kernel_plan.py"],
}
ENGINE_TESTS = ["tests/core/engine"]

# Smallest and most central first: the default loop measures these in this order.
MODULES = [
    "kvflow/events/bus.py",
    "kvflow/core/tiers/diskfile.py",
    "kvflow/core/tiers/l1.py",
    "kvflow/core/tiers/l1space.py",
    "kvflow/core/server/protocol.py",
    "kvflow/core/engine/writethrough.py",
    "kvflow/core/tiers/sharding.py",
    "kvflow/core/tiers/base.py",
    "kvflow/core/tiers/hostmem.py",
    "kvflow/core/tiers/disk.py",
    "kvflow/core/tiers/redis.py",
    # split out of redis.py (issue 40)
    "kvflow/core/tiers/redisformat.py",
    "kvflow/core/tiers/redislink.py",
    "kvflow/core/tiers/redisnodes.py",
    "kvflow/core/tiers/redisstats.py",
    "kvflow/core/tiers/redis_target.py",
    "kvflow/core/engine/keys.py",
    "kvflow/core/engine/request.py",
    "kvflow/core/engine/ops.py",
    "kvflow/core/engine/instances.py",
    "kvflow/core/engine/observability.py",
    "kvflow/core/engine/activity.py",
    "kvflow/core/engine/tiering.py",
    "kvflow/core/engine/loads.py",
    "kvflow/core/engine/movers.py",
    "kvflow/core/engine/cache_engine.py",
    # split out of cache_engine.py (issue 40)
    "kvflow/core/engine/validation.py",
    "kvflow/core/engine/queries.py",
    "kvflow/core/engine/transfers.py",
    "kvflow/core/engine/l2_from_config.py",
    "kvflow/core/engine/bus_status.py",
    # added with the layerwise copies straight into blocks (issue 35)
    "kvflow/core/engine/direct.py",
    # the CPU mover's copy list (issue 36; its C loop, csrc/strided_copy.c, is no Python)
    "kvflow/kernels/reference.py",
    "kvflow/core/tiers/pinahead.py",
    "kvflow/core/server/shm.py",
    "kvflow/core/server/curve.py",
    "kvflow/core/server/ipc.py",
    "kvflow/core/server/sharing.py",
    "kvflow/core/server/client.py",
    "kvflow/core/server/server.py",
    "kvflow/core/server/jobs.py",
    "kvflow/core/server/registry.py",
    "kvflow/core/server/cli.py",
    # added with the engine's staging ring (issue 35)
    "kvflow/core/server/staging.py",
    "kvflow/core/server/layers.py",
    "kvflow/core/polling.py",
]


def tests_for(module: str) -> list[str]:
    if module in TESTS_BY_MODULE:
        return TESTS_BY_MODULE[module]
    if module.startswith("kvflow/core/engine/"):
        return ENGINE_TESTS
    path = Path(module)
    folder = Path("tests", *path.parent.parts[1:])
    matches = sorted(
        str(p.relative_to(REPO)) for p in (REPO / folder).glob(f"test_{path.stem}*.py")
    )
    return matches or [str(folder)]


def copy_tree(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


@dataclass(frozen=True)
class RunOptions:
    """How `make mutation` runs each module (see main's flags)."""

    max_children: int = 1
    recheck: bool = False
    resume: bool = False
    gpu: bool = False
    seed: Path | None = None


def mutmut_table(work: Path, module: str, tests: list[str], gpu: bool) -> str:
    # Copied into mutmut's mutants/ folder, where the tests run: every top-level entry of the
    # copy the tests may read (docs, benchmarks, Makefile ...), besides tests/ and pyproject.toml.
    also_copy = sorted(
        p.name for p in work.iterdir() if p.name not in {"kvflow", "tests", "mutants"}
    )
    pytest_args = ["-p", "no:randomly", "-p", "tests.support.mutation_hits"]
    if not gpu:
        pytest_args += ["-m", "not gpu"]
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["kvflow"]\n'
        f"only_mutate = {json.dumps([module])}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        # -p no:randomly: mutmut records per-test timings and runs tests in its own order.
        # -p tests.support.mutation_hits: hits inside the tests' subprocesses count too.
        # Without --gpu, -m "not gpu": the gpu-marked tests need a GPU.
        f"pytest_add_cli_args = {json.dumps(pytest_args)}\n"
        f"also_copy = {json.dumps(also_copy)}\n"
        # A mutant that hangs is stopped after (recorded test time + 10 s) x 5 of wall time
        # (mutmut's default, x 15 + 1 s, let one hung server test run four minutes; the
        # recorded time leaves out the module fixtures that start servers, hence the 10 s).
        "timeout_multiplier = 5.0\n"
        "timeout_constant = 10.0\n"
    )


def score(stats: dict[str, int]) -> float:
    counted = stats["total"] - stats["skipped"]
    return 100.0 * (stats["killed"] + stats["timeout"]) / counted if counted else 0.0


def not_killed(work: Path, mutmut: list[str], env: dict[str, str]) -> list[str]:
    """The mutants of the last run in `work` that survived or that no test reached."""
    out = subprocess.run(
        [*mutmut, "results"], cwd=work, env=env, check=True, capture_output=True, text=True
    ).stdout
    names = []
    for line in out.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if status in ("survived", "no tests"):
            names.append(name)
    return names


def module_folder(root: Path, module: str) -> Path:
    return root / module.removesuffix(".py").replace("/", ".")


def mutmut_env(work: Path | None = None) -> dict[str, str]:
    # A mutant that makes a test wait forever (a flush that never ends) would sit out the
    # suite's 300 s pytest-timeout and, asleep, never reach mutmut's CPU-time limit: 60 s
    # is ample for any single test these modules map to (the slowest take ~5 s alone, up to
    # ~40 s with a dozen modules mutated at once).
    # PYTHONPATH <folder>/mutants (where mutmut runs the tests): a helper script a test runs
    # by path imports the mutated copy, as `python -m` subprocesses started there already
    # do, rather than an installed kvflow (or none).
    # <folder>/hooks (first): the sitecustomize.py through which the tests' subprocesses
    # report the functions they reach to mutmut's recording pass (tests/support/mutation_hits).
    # PYTORCH_NVML_BASED_CUDA_CHECK: the gpu tests' skipif asks torch whether CUDA is there
    # while mutmut's fork server collects them; asked through NVML, that leaves CUDA
    # uninitialised, so the forked mutant runs can still use the GPU.
    # OMP_NUM_THREADS=1: mutmut's CPU-time limit counts every thread, and many mutants run
    # side by side anyway; torch's default of one thread per core ran into that limit.
    env = {
        "PYTEST_TIMEOUT": "60",
        "OMP_NUM_THREADS": "1",
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    }
    if work is None:
        return env
    folders = [str(work / "hooks"), str(work / "mutants"), os.environ.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, folders))
    env[mutation_hits.HITS_ENV] = str(work / "hits")
    return env


MUTMUT = [sys.executable, "-m", "mutmut"]


def prepare(module: str, work: Path, options: RunOptions) -> list[str] | None:
    """Set up `work` for a run; the mutant names to run (empty: all), None: nothing to do."""
    names: list[str] = []
    if options.recheck:
        # Only the mutants the last run left alive, against the repo's current tests
        # (mutmut notices new tests and records which functions they reach).
        if not (work / "mutants").is_dir():
            sys.exit(f"make mutation: --recheck needs an earlier run of {module} in {work}")
        names = not_killed(work, MUTMUT, mutmut_env())
        if not names:
            print(f"== {module}: nothing left to recheck", flush=True)
            return None
        shutil.rmtree(work / "tests")
    elif options.resume and (work / "mutants").is_dir():
        # mutmut keeps each mutant's result as it goes and runs only those without one.
        return names
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    copy_tree(work)
    add_table(work, module, options.gpu)
    if options.seed is not None and not options.recheck:
        seed_results(module, module_folder(options.seed, module), work)
    return names


def seed_results(module: str, earlier: Path, work: Path) -> None:
    """Start from an earlier run's verdicts (a folder copied back from another machine):
    mutmut keeps each one whose function is unchanged (same AST hash, so the same Python
    minor version) and runs only the rest; its survivors stay survivors until --recheck."""
    results = Path("mutants") / f"{module}.meta"
    if not (earlier / results).is_file():
        print(f"== {module}: no earlier results in {earlier}; running every mutant", flush=True)
        return
    (work / results).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(earlier / results, work / results)


def add_table(work: Path, module: str, gpu: bool) -> None:
    pyproject = work / "pyproject.toml"
    if "mutmut" in tomllib.loads(pyproject.read_text()).get("tool", {}):
        sys.exit("make mutation: pyproject.toml has a [tool.mutmut] table of its own; remove it")
    table = mutmut_table(work, module, tests_for(module), gpu)
    pyproject.write_text(pyproject.read_text() + table)


def collect(module: str, work: Path) -> dict[str, int]:
    """Counts of the module's mutants so far; writes the per-mutant list to survivors.txt."""
    env = mutmut_env()
    subprocess.run(
        [*MUTMUT, "export-cicd-stats"], cwd=work, env=env, check=True, capture_output=True
    )
    stats: dict[str, int] = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
    results = subprocess.run(
        [*MUTMUT, "results"], cwd=work, env=env, check=True, capture_output=True, text=True
    ).stdout
    (work / "survivors.txt").write_text(results)
    return stats


def summary(module: str, stats: dict[str, int]) -> str:
    decided = sum(v for k, v in stats.items() if k != "total")
    return (
        f"== {module}: killed {stats['killed'] + stats['timeout']}/{stats['total'] - stats['skipped']}"
        f" = {score(stats):.1f}% (survived {stats['survived']}, no tests {stats['no_tests']},"
        f" timeout {stats['timeout']}, crashed {stats.get('segfault', 0)},"
        f" suspicious {stats['suspicious']}, skipped {stats['skipped']},"
        f" not checked yet {stats['total'] - decided})"
    )


def run_module(
    module: str, root: Path, options: RunOptions, log: IO[str] | None = None
) -> dict[str, int] | None:
    if not (REPO / module).is_file():
        sys.exit(f"make mutation: no such module: {module}")
    work = module_folder(root, module)
    names = prepare(module, work, options)
    if names is None:
        return collect(module, work)
    print(f"== {module}: tests {' '.join(tests_for(module))} (in {work})", flush=True)
    command = [*MUTMUT, "run", "--max-children", str(options.max_children), *names]
    # On PYTHONPATH (mutmut_env) from the start: a folder missing when the interpreter
    # starts is cached as holding nothing, and the tests' own imports then fail.
    (work / "mutants").mkdir(exist_ok=True)
    (work / "hits").mkdir(exist_ok=True)
    mutation_hits.install_sitecustomize(work / "hooks")
    with subprocess.Popen(command, cwd=work, env=mutmut_env(work), stdout=log, stderr=log) as proc:
        try:
            returncode = proc.wait()
        except BaseException:  # Ctrl-C or SIGTERM: stop mutmut and its workers too
            proc.terminate()
            proc.wait(30)
            raise
    if returncode != 0:
        print(f"== {module}: mutmut run failed (exit {returncode})", flush=True)
        return None
    stats = collect(module, work)
    if log is None:
        print((work / "survivors.txt").read_text(), end="")
    print(summary(module, stats), flush=True)
    return stats


def run_logged(module: str, root: Path, options: RunOptions) -> dict[str, int] | None:
    """run_module with mutmut's output in <folder>/mutmut.log (for --jobs > 1)."""
    work = module_folder(root, module)
    work.parent.mkdir(parents=True, exist_ok=True)
    log_path = root / f"{work.name}.log"
    with log_path.open("a") as log:
        return run_module(module, root, options, log)


def write_diffs(work: Path) -> None:
    """<folder>/survivors.diff: `mutmut show` of every mutant no test killed so far."""
    env = mutmut_env()
    shows = [
        subprocess.run(
            [*MUTMUT, "show", name], cwd=work, env=env, capture_output=True, text=True
        ).stdout
        for name in not_killed(work, MUTMUT, env)
    ]
    (work / "survivors.diff").write_text("".join(shows))


def progress_line(root: Path, module: str, diffs: bool) -> str:
    work = module_folder(root, module)
    if not (work / "mutants").is_dir():
        return f"== {module}: not started"
    with contextlib.suppress(subprocess.CalledProcessError, OSError, ValueError):
        line = summary(module, collect(module, work))
        if diffs:
            write_diffs(work)
        return line
    return f"== {module}: no counts yet (mutmut is still collecting its tests)"


def progress(root: Path, modules: list[str], diffs: bool, jobs: int) -> None:
    """Every module's counts so far, from its folder (mutmut may still be running there)."""
    with ThreadPoolExecutor(jobs) as pool:
        for line in pool.map(lambda m: progress_line(root, m, diffs), modules):
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "modules", nargs="*", help="kvflow/... .py paths (default: every module in MODULES)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("KVFLOW_MUTATION_DIR", "/tmp/kvflow-mutation")),
        help="scratch folder, outside the repo (default $KVFLOW_MUTATION_DIR or /tmp/kvflow-mutation)",
    )
    parser.add_argument("--max-children", type=int, default=1, help="parallel mutants (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="modules mutated at once (default 1)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep each module's folder and go on where its last run stopped",
    )
    parser.add_argument(
        "--progress", action="store_true", help="print each module's counts so far; run nothing"
    )
    parser.add_argument(
        "--diffs",
        action="store_true",
        help="with --progress: write each module's surviving mutants to <folder>/survivors.diff",
    )
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="rerun only the mutants the last run left alive, with the repo's current tests",
    )
    parser.add_argument(
        "--seed",
        type=Path,
        help="a scratch folder of an earlier run (say, from another machine): its verdicts of"
        " unchanged functions are kept",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="run the gpu-marked tests too (a GPU machine): movers, ipc and the CUDA paths",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("make mutation: terminated"))
    root = args.dir.resolve()
    if root == REPO or REPO in root.parents:
        sys.exit("make mutation: the scratch folder must be outside the repo")
    modules = args.modules or MODULES
    if args.progress:
        progress(root, modules, args.diffs, args.jobs)
        return
    options = RunOptions(args.max_children, args.recheck, args.resume, args.gpu, args.seed)
    if args.jobs > 1:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {m: pool.submit(run_logged, m, root, options) for m in modules}
            results = {m: f.result() for m, f in futures.items()}
    else:
        results = {m: run_module(m, root, options) for m in modules}
    print("\nmodule | killed/total | score")
    for module, stats in results.items():
        if stats is None:
            print(f"{module} | failed | -")
        else:
            counted = stats["total"] - stats["skipped"]
            print(
                f"{module} | {stats['killed'] + stats['timeout']}/{counted} | {score(stats):.1f}%"
            )


if __name__ == "__main__":
    main()
